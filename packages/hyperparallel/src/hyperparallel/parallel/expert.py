"""Expert parallelism: experts ``[E, ...]`` split over ``ep``, tokens moved by all-to-all.

Dropless: every (token, expert) pair the router chooses is computed, however uneven the load, by
exchanging the per-expert counts first and then the tokens with ``all_to_all_single`` and uneven
split sizes. The exchanges are asynchronous (:mod:`hyperparallel.parallel.all_to_all`) and
overlap with expert compute in one of two ways, in forward and backward: chunked by local expert
group (a chunk's experts compute while the other chunks travel), or local-first (the rows a rank
routes to its own experts never travel and compute while the others do). The router and its
balance loss are computed locally as without EP, so they are unchanged.

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
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from hyperparallel._config import StrictModel
from hyperparallel.models.moe import MoEFeedForward
from hyperparallel.parallel.all_to_all import start_all_to_all, wait_all_to_all
from hyperparallel.parallel.dispatch_plan import (
    DispatchPlan,
    expert_groups,
    plan_dispatch,
    split_local,
)
from hyperparallel.parallel.mesh import MeshSet

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")

ExpertCompute = Callable[[torch.Tensor, torch.Tensor, int, list[int]], torch.Tensor]
"""``(rows [R, D], expert of each row within the chunk [R], chunk c, rows per expert of the
chunk) -> [R, D_out]``: the experts of chunk ``c`` (:meth:`ExpertParallelDispatch.chunk_experts`)
applied to the rows this rank received for them, which arrive grouped by expert (ascending).
Called once per chunk, also with ``R == 0``; local-first calls it twice for its one chunk, on
the rows routed from this rank, then on those received from the others. It must not
communicate: the local expert slices are gathered once per dispatch, before it
(:meth:`ExpertParallelDispatch.local_experts`)."""

DEFAULT_CHUNKS = 1
"""Blocking dispatch by default: on 2 CPU ranks over gloo (benchmarks/expert_overlap.py, results
in benchmarks/results/expert_overlap.md) no chunk count above 1 made the step faster. gloo's
exchanges run on the same cores as the experts, the blocking dispatch waits only a few percent of
the step, and each extra chunk adds two exchanges and an expert call. Local-first dispatch was
slower too (about 1.1x): it calls every expert twice, on half the rows each. Where the exchange
runs beside the compute (an accelerator's communication engine), try ``chunks`` above 1 or
``local_first`` and measure."""


class ExpertDispatchConfig(StrictModel):
    """How expert-parallel dispatch overlaps its all-to-alls with the expert compute."""

    chunks: int = Field(
        DEFAULT_CHUNKS,
        ge=1,
        le=64,
        description="Groups the local experts are split into; group c computes while the later "
        "groups' tokens travel and the earlier groups' outputs return (1: exchange everything, "
        "then compute, no overlap). Capped at the number of local experts.",
    )
    local_first: bool = Field(
        False,
        description="Keep the rows a rank routes to its own experts out of the exchanges and "
        "compute them while the other rows travel (and their gradients return); the "
        "exchanges carry only the remote rows. Needs chunks=1.",
    )

    @model_validator(mode="after")
    def _one_overlap(self) -> ExpertDispatchConfig:
        if self.local_first and self.chunks > 1:
            raise ValueError(
                f"local_first overlaps the exchange with the local rows' experts; with "
                f"chunks={self.chunks} choose one: chunks=1 or local_first=false"
            )
        return self


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
        config: the chunking (default :class:`ExpertDispatchConfig`).
    """

    def __init__(
        self, meshes: MeshSet, n_experts: int, config: ExpertDispatchConfig | None = None
    ) -> None:
        assert meshes.ep is not None and meshes.experts is not None
        self.group = meshes.ep.get_group()
        self.ep = meshes.ep.size()
        self.n_experts = n_experts
        self.n_local = n_experts // self.ep
        config = config or ExpertDispatchConfig()
        self.groups = expert_groups(self.n_local, config.chunks)
        """The chunks' groups of local experts, the same on every rank."""
        self.local_first = config.local_first
        self.rank = dist.get_rank(self.group)
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

    def chunk_experts(self, local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``local: [E / ep, ...]`` split into the chunks' groups of experts. One split for all
        chunks: its backward concatenates their gradients once, where slicing per chunk would
        add a zero-filled ``[E / ep, ...]`` gradient per chunk."""
        return local.split([group.stop - group.start for group in self.groups])

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

        Every chunk's rows leave at once; chunk ``c`` is computed as soon as it has arrived,
        while the later chunks are still travelling and the earlier chunks' outputs are on their
        way back. Backward runs the same pipeline in reverse. Each expert sees all its rows in
        one call, so its GEMMs are as large as without chunks. An index ``>= E`` (the skip
        sentinel some routers emit) is not sent anywhere and adds nothing to its token's output.
        Local-first: see :meth:`_dispatch_local_first`.
        """
        plan = self._plan(experts)
        if self.local_first:
            return self._dispatch_local_first(tokens, weights, plan, experts.shape[1], compute)
        top_k = experts.shape[1]
        send = tokens[plan.pairs // top_k].split(plan.send_rows)
        inbound = [
            start_all_to_all(rows, recv, sent, self.group)
            for rows, sent, recv in zip(send, plan.send_splits, plan.recv_splits, strict=True)
        ]
        outbound = []
        for c, group in enumerate(self.groups):
            got = wait_all_to_all(*inbound[c])
            # Rows arrive ordered by (source rank, expert); group them by expert.
            counts = plan.recv_counts[:, group]
            ids = torch.arange(counts.shape[1], device=got.device).repeat(self.ep)
            row_ids = ids.repeat_interleave(counts.reshape(-1), output_size=got.shape[0])
            by_expert = row_ids.argsort(stable=True)
            computed = compute(got[by_expert], row_ids[by_expert], c, plan.recv_per_expert[c])
            back = torch.empty_like(computed).index_copy(0, by_expert, computed)
            outbound.append(
                start_all_to_all(back, plan.send_splits[c], plan.recv_splits[c], self.group)
            )
        returned = torch.cat([wait_all_to_all(*exchange) for exchange in outbound])
        weighted = (returned * weights.reshape(-1)[plan.pairs, None]).to(tokens.dtype)
        out = tokens.new_zeros(tokens.shape[0], weighted.shape[1])
        return out.index_add(0, plan.pairs // top_k, weighted)

    def _dispatch_local_first(
        self,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        whole: DispatchPlan,
        top_k: int,
        compute: ExpertCompute,
    ) -> torch.Tensor:
        """:meth:`dispatch` with the rows routed to this rank's own experts kept out of the
        exchange: the remote rows leave, the local rows compute, the received rows compute once
        they arrive; their outputs leave and the local outputs are combined while they travel.

        Backward mirrors it through the exchange nodes. Autograd runs the ready nodes newest
        first, so the local rows' expert backward (created between the dispatch's start and
        wait) runs after the received rows' backward has started the reverse dispatch exchange
        and before it is waited for.
        """
        plan = split_local(whole, self.rank)
        local_tokens = plan.local_pairs // top_k
        remote_tokens = plan.remote_pairs // top_k
        inbound = start_all_to_all(
            tokens[remote_tokens], plan.recv_splits, plan.send_splits, self.group
        )
        experts = torch.arange(self.n_local, device=tokens.device)
        local_ids = experts.repeat_interleave(
            torch.tensor(plan.local_per_expert, device=tokens.device),
            output_size=local_tokens.shape[0],
        )
        local = compute(tokens[local_tokens], local_ids, 0, plan.local_per_expert)
        got = wait_all_to_all(*inbound)
        # Rows arrive ordered by (source rank, expert); group them by expert.
        row_ids = experts.repeat(self.ep).repeat_interleave(
            plan.recv_counts.reshape(-1), output_size=got.shape[0]
        )
        by_expert = row_ids.argsort(stable=True)
        computed = compute(got[by_expert], row_ids[by_expert], 0, plan.recv_per_expert)
        back = torch.empty_like(computed).index_copy(0, by_expert, computed)
        outbound = start_all_to_all(back, plan.send_splits, plan.recv_splits, self.group)
        flat_weights = weights.reshape(-1)
        out = tokens.new_zeros(tokens.shape[0], local.shape[1])
        local_weighted = local * flat_weights[plan.local_pairs, None]
        out = out.index_add(0, local_tokens, local_weighted.to(tokens.dtype))
        returned = wait_all_to_all(*outbound)
        remote_weighted = returned * flat_weights[plan.remote_pairs, None]
        return out.index_add(0, remote_tokens, remote_weighted.to(tokens.dtype))

    def _plan(self, experts: torch.Tensor) -> DispatchPlan:
        """Exchange the per-expert counts (blocking: the splits must be known on the host) and
        plan the chunks."""
        flat = experts.reshape(-1)
        counts = torch.bincount(flat, minlength=self.n_experts)[: self.n_experts]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        return plan_dispatch(flat, counts, received, self.groups)

    def __call__(
        self,
        ffn: MoEFeedForward,
        tokens: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """The built-in MoE's experts (SwiGLU on ``w_gate, w_up, w_down``) under EP: see
        :meth:`dispatch`."""
        # one unbind per weight: its backward stacks the experts' gradients once (indexing
        # w[j] per expert would add a zero-filled [E / ep, ...] gradient per expert)
        w_gate, w_up, w_down = (
            self.local_experts(getattr(ffn, n)).unbind() for n in EXPERT_WEIGHTS
        )

        def swiglu(
            rows: torch.Tensor, _ids: torch.Tensor, chunk: int, per_expert: list[int]
        ) -> torch.Tensor:
            first = self.groups[chunk].start
            outputs = [
                (F.silu(h @ w_gate[j]) * (h @ w_up[j])) @ w_down[j]
                for j, h in enumerate(rows.split(per_expert), start=first)
            ]
            return torch.cat(outputs)

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


def apply_expert_parallel(
    model: nn.Module, meshes: MeshSet, config: ExpertDispatchConfig | None = None
) -> list[nn.Parameter]:
    """Place every MoE layer's experts on the expert mesh and route its tokens by all-to-all,
    overlapped as ``config`` says (default :class:`ExpertDispatchConfig`).

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
        dispatch = ExpertParallelDispatch(meshes, n_experts, config)
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
