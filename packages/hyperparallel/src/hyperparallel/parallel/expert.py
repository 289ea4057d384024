"""Expert parallelism: experts ``[E, ...]`` split over ``ep``, tokens moved by all-to-all.

Dropless: every (token, expert) pair the router chooses is computed, however uneven the load, by
exchanging the per-expert counts first and then the tokens with ``all_to_all_single`` and uneven
split sizes (torch.distributed.nn's autograd version, so backward runs the reverse exchange). The
router and its balance loss are computed locally as without EP, so they are unchanged.

Expert weights are DTensors on the expert mesh, ``Shard(0)`` over ``ep`` and ``dp_shard`` and
``Replicate()`` over ``dp_replicate``: each rank stores ``E / (ep x dp_shard)`` experts (the layout
distributed Muon orthogonalises locally) and DCP saves and reshards them by global offsets. A
forward gathers its ep group's ``E / ep`` experts over ``dp_shard``; backward reduce-scatters
their gradients over ``dp_shard`` and sums them over ``dp_replicate``, and the sum over the ep
group arrives through the all-to-all. Scaling by ``1 / dp ranks`` makes it the mean gradient
FSDP gives the dense weights.

:class:`ExpertParallelDispatch` is the model-independent part (token exchange, local expert
slices, combine with the router weights); what runs on the received rows is a callback. Two
adapters use it: the built-in :class:`~hyperparallel.models.moe.MoEFeedForward`
(:func:`apply_expert_parallel`, SwiGLU on ``w_gate, w_up, w_down``) and the expert modules of
`transformers` MoE families (:mod:`hyperparallel.parallel.hf_expert`, which runs the library's own
expert code on the local slices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from hyperparallel.models.moe import MoEFeedForward
from hyperparallel.parallel.mesh import MeshSet

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")

ExpertCompute = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]
"""``(rows [R, D], local expert id of each row [R], rows per local expert) -> [R, D_out]``: the
experts of this rank applied to the rows it received, which arrive grouped by local expert
(ascending). Called on every rank for every dispatch, also with ``R == 0``, because it may run
collectives (gathering the local expert slices)."""


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class KeepInGraph(torch.autograd.Function):
    """``KeepInGraph.apply(out, *tensors)``: ``out`` unchanged, and ``tensors`` receive a zero
    gradient in backward.

    Why: a rank whose received rows miss some (or all) of its experts would otherwise leave those
    slices out of the graph, skip their backward and with it the reduce-scatter over
    ``dp_shard`` that the other ranks of the group run: a hang, not a wrong number.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = (torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes)
        return (grad, *zeros)


class ExpertParallelDispatch:
    """Token dispatch and combine for one MoE layer over an ep process group.

    Args:
        meshes: the job's meshes (``meshes.ep`` and ``meshes.experts`` must be set).
        n_experts: E, divisible by ``ep x dp_shard``.
    """

    def __init__(self, meshes: MeshSet, n_experts: int) -> None:
        assert meshes.ep is not None and meshes.experts is not None
        self.group = meshes.ep.get_group()
        self.ep = meshes.ep.size()
        self.ep_rank = meshes.ep.get_local_rank()
        self.n_experts = n_experts
        self.n_local = n_experts // self.ep
        self.mesh = meshes.experts
        names = self.mesh.mesh_dim_names or ()
        self.stored = [Shard(0) if n in ("ep", "dp_shard") else Replicate() for n in names]
        self.gathered = [Shard(0) if n == "ep" else Replicate() for n in names]
        self.grad_in = [Shard(0) if n == "ep" else Partial() for n in names]
        self.grad_scale = 1.0 / meshes.dims.dp_size

    def place(self, full: torch.Tensor) -> nn.Parameter:
        """A full ``[E, ...]`` stack as the stored expert DTensor parameter (identical ``full`` on
        every rank, e.g. built from the same seed)."""
        return nn.Parameter(distribute_tensor(full.detach(), self.mesh, self.stored))

    def local_experts(self, weight: torch.Tensor) -> torch.Tensor:
        """This ep rank's ``[E / ep, ...]`` experts from the stored DTensor (differentiable)."""
        assert isinstance(weight, DTensor)
        local = weight.redistribute(self.mesh, self.gathered).to_local(grad_placements=self.grad_in)
        scaled: torch.Tensor = _ScaleGrad.apply(local, self.grad_scale)
        return scaled

    def dispatch(
        self,
        tokens: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        compute: ExpertCompute,
    ) -> torch.Tensor:
        """Route ``tokens: [T, D]`` to their top-k ``experts: [T, k]`` (int) on the ranks that
        hold them, run ``compute`` there, bring the outputs back and combine them with the router
        ``weights: [T, k]``. Returns ``[T, D_out]`` in ``tokens``' dtype.

        An index ``>= E`` (the skip sentinel some routers emit) is not sent anywhere and adds
        nothing to its token's output.
        """
        n_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by global expert
        counts = torch.bincount(flat, minlength=self.n_experts)[: self.n_experts]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # received[s * n_local + j]: pairs rank s sends to this rank's local expert j
        send_splits = counts.view(self.ep, self.n_local).sum(dim=1).tolist()
        order = order[: sum(send_splits)]  # sentinels sort last and are dropped
        recv_matrix = received.view(self.ep, self.n_local)
        recv_splits = recv_matrix.sum(dim=1).tolist()
        send = tokens[order // top_k]
        got = dist_fn.all_to_all_single(
            send.new_empty(sum(recv_splits), send.shape[1]),
            send,
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self.group,
        )
        # Received rows are ordered by (source rank, local expert); group them by local expert.
        local_ids = torch.arange(self.n_local, device=flat.device).repeat(self.ep)
        row_ids = local_ids.repeat_interleave(recv_matrix.reshape(-1))
        by_expert = row_ids.argsort(stable=True)
        per_expert = recv_matrix.sum(dim=0).tolist()
        computed = compute(got[by_expert], row_ids[by_expert], per_expert)
        back = torch.empty_like(computed).index_copy(0, by_expert, computed)
        returned = dist_fn.all_to_all_single(
            back.new_empty(order.numel(), back.shape[1]),
            back,
            output_split_sizes=send_splits,
            input_split_sizes=recv_splits,
            group=self.group,
        )
        weighted = (returned * weights.reshape(-1)[order, None]).to(tokens.dtype)
        return tokens.new_zeros(n_tokens, weighted.shape[1]).index_add(0, order // top_k, weighted)

    def __call__(
        self,
        ffn: MoEFeedForward,
        tokens: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """The built-in MoE's experts (SwiGLU on ``w_gate, w_up, w_down``) under EP: see
        :meth:`dispatch`."""

        def swiglu(rows: torch.Tensor, _ids: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
            w_gate, w_up, w_down = (self.local_experts(getattr(ffn, n)) for n in EXPERT_WEIGHTS)
            outputs = [
                (F.silu(h @ w_gate[j]) * (h @ w_up[j])) @ w_down[j]
                for j, h in enumerate(rows.split(per_expert))
            ]
            return torch.cat(outputs) if outputs else rows.new_empty(0, w_down.shape[-1])

        return self.dispatch(tokens, experts, weights, swiglu)


def check_divisible(n_experts: int, ep: int, dp_shard: int, what: str) -> None:
    """Refuse a layout where a rank would store part of an expert.

    Raises:
        ValueError: ``what`` (the setting holding E) not divisible by ``ep x dp_shard``.
    """
    if n_experts % (ep * dp_shard):
        raise ValueError(
            f"{what}={n_experts} must be divisible by ep x dp_shard = {ep} x {dp_shard} "
            "(each rank stores whole experts)"
        )


def apply_expert_parallel(model: nn.Module, meshes: MeshSet) -> list[nn.Parameter]:
    """Place every MoE layer's experts on the expert mesh and route its tokens by all-to-all.

    Call before FSDP (pass the returned parameters as its ``ignored_params``): the expert
    DTensors are managed here, not by FSDP.

    Raises:
        ValueError: E not divisible by ``ep x dp_shard`` (naming both).
    """
    dims = meshes.dims
    placed: list[nn.Parameter] = []
    for module in model.modules():
        if not isinstance(module, MoEFeedForward):
            continue
        n_experts = module.w_gate.shape[0]
        check_divisible(n_experts, dims.ep, dims.dp_shard, "model.n_experts")
        dispatch = ExpertParallelDispatch(meshes, n_experts)
        for name in EXPERT_WEIGHTS:
            param = dispatch.place(getattr(module, name))
            setattr(module, name, param)
            placed.append(param)
        module.dispatch = dispatch
    return placed


def keep_in_graph(out: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:class:`KeepInGraph` as a typed function."""
    kept: torch.Tensor = KeepInGraph.apply(out, *tensors)
    return kept
