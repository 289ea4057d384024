"""Expert parallelism for `transformers` MoE models, generic over families.

Every MoE family hyperparallel registers (Qwen3-MoE, Qwen3-Next, GLM-4.5, MiniMax-M2, gpt-oss,
DeepSeek-V3/V3.2) keeps its routed experts in one module with the same contract:
``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, every
parameter stacked on dim 0 over the experts (``gate_up_proj``, ``down_proj``; gpt-oss also
``gate_up_proj_bias``, ``down_proj_bias``), and ``num_experts`` sizing its expert mask. So the
experts are not re-implemented here: each such module's forward is replaced by
:meth:`~hyperparallel.parallel.expert.ExpertParallelDispatch.dispatch`, whose compute step runs
the module's *own* forward on the rows this rank received for one chunk, with its parameters
swapped for that chunk's slices of this rank's ``E / ep`` experts, ``num_experts`` set to their
count, the expert index within the chunk as a top-1 choice and weight 1. The router weights are
applied once, in the combine. Whatever expert kernel the model is configured with
(``config._experts_implementation``: eager loop, ``grouped_mm``, ``batched_mm``) runs unchanged,
on fewer experts.

The modules are found by the family plan's ``experts`` pattern (the owners of the parameters it
matches), so a new family with the same contract needs no code here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from hyperparallel.models.families import FamilyPlan
from hyperparallel.parallel.expert import (
    ExpertDispatchConfig,
    ExpertParallelDispatch,
    check_divisible,
    keep_in_graph,
)
from hyperparallel.parallel.mesh import MeshSet


def expert_modules(model: nn.Module, plan: FamilyPlan) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every routed-experts module of ``model``, in model order: the
    owners of the parameters that ``plan.experts`` matches.

    Raises:
        ValueError: such a module without an integer ``num_experts``, or with a parameter not
            stacked over its experts on dim 0 (not the contract this adapter relies on).
    """
    if plan.experts is None:
        return []
    owners: dict[str, nn.Module] = {}
    for name, _ in model.named_parameters():
        if re.search(plan.experts, name):
            owner = name.rpartition(".")[0]
            owners.setdefault(owner, model.get_submodule(owner))
    for name, module in owners.items():
        n_experts = getattr(module, "num_experts", None)
        if not isinstance(n_experts, int):
            raise ValueError(
                f"{name} ({type(module).__name__}): no integer num_experts attribute; expert "
                "parallelism needs the transformers experts contract (see "
                "hyperparallel.parallel.hf_expert)"
            )
        for pname, param in module.named_parameters(recurse=False):
            if param.ndim == 0 or param.shape[0] != n_experts:
                raise ValueError(
                    f"{name}.{pname}: shape {tuple(param.shape)} is not stacked over the "
                    f"{n_experts} experts on dim 0; expert parallelism cannot shard it"
                )
    return list(owners.items())


def num_experts(module: nn.Module) -> int:
    """The ``num_experts`` of a transformers experts module (checked by :func:`expert_modules`)."""
    value = module.__dict__["num_experts"]
    assert isinstance(value, int)
    return value


class HFExpertParallel:
    """The replacement forward of one transformers experts module under EP.

    Installed as the module's instance ``forward`` (the class's forward stays reachable, and
    parameter names do not change, so checkpoints and optimizer routing keep the library's
    names).
    """

    def __init__(self, module: nn.Module, dispatch: ExpertParallelDispatch) -> None:
        self.module = module
        self.dispatch = dispatch
        self.names = [name for name, _ in module.named_parameters(recurse=False)]
        self.class_forward = type(module).forward

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' forward contract: ``[T, H], [T, k], [T, k] -> [T, H]``."""
        chunks = {
            name: self.dispatch.chunk_experts(
                self.dispatch.local_experts(getattr(self.module, name))
            )
            for name in self.names
        }

        def compute(rows: Tensor, ids: Tensor, chunk: int, per_expert: list[int]) -> Tensor:
            """The module's own forward on one chunk's rows with that chunk's expert slices."""
            sliced = {name: pieces[chunk] for name, pieces in chunks.items()}
            ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            with _local_view(self.module, sliced, len(per_expert)):
                out: Tensor = self.class_forward(self.module, rows, ids[:, None], ones)
            return keep_in_graph(out, list(sliced.values()))

        return self.dispatch.dispatch(hidden_states, top_k_index, top_k_weights, compute)


@contextmanager
def _local_view(
    module: nn.Module, tensors: dict[str, torch.Tensor], n_local: int
) -> Iterator[None]:
    """``module`` with its parameters replaced by ``tensors`` and ``num_experts = n_local``
    for the duration (what ``torch.func.functional_call`` does to parameters; done directly so
    that the class forward, not the installed EP forward, runs)."""
    params = cast(dict[str, Any], module._parameters)
    saved = {name: params[name] for name in tensors}
    n_experts = num_experts(module)
    try:
        params.update(tensors)
        setattr(module, "num_experts", n_local)  # noqa: B010 (an int attribute, not a Tensor)
        yield
    finally:
        params.update(saved)
        setattr(module, "num_experts", n_experts)  # noqa: B010


def apply_hf_expert_parallel(
    model: nn.Module,
    plan: FamilyPlan,
    meshes: MeshSet,
    config: ExpertDispatchConfig | None = None,
) -> list[nn.Parameter]:
    """Place every experts module's stacks on the expert mesh and route their tokens by
    all-to-all, chunked as ``config`` says (default :class:`ExpertDispatchConfig`). Call before
    FSDP and pass the returned parameters as its ``ignored_params``.

    Raises:
        ValueError: no experts module (a dense model), or E not divisible by
            ``ep x dp_shard`` (naming both).
    """
    dims = meshes.dims
    found = expert_modules(model, plan)
    if not found:
        raise ValueError(
            f"--mesh {dims.spec()}: {type(model).__name__} has no routed experts to shard "
            "over ep; train it on dp_replicate x dp_shard"
        )
    placed: list[nn.Parameter] = []
    for name, module in found:
        n_experts = num_experts(module)
        check_divisible(n_experts, dims.ep, dims.dp_shard, f"{name}.num_experts")
        dispatch = ExpertParallelDispatch(meshes, n_experts, config)
        for pname in [p for p, _ in module.named_parameters(recurse=False)]:
            param = dispatch.place(getattr(module, pname))
            setattr(module, pname, param)
            placed.append(param)
        module.forward = HFExpertParallel(module, dispatch)
    return placed
