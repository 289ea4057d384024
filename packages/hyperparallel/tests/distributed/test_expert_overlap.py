"""Overlapped expert dispatch on 2 gloo ranks (ep=2, 4 local experts per rank).

Every chunk count and local-first dispatch give the outputs and gradients of the single-process
layer (and so of the blocking dispatch, chunks=1), with uneven loads: one expert receives no
tokens from any rank, one rank sends nothing to some experts, and some slots carry the skip
sentinel; a second routing gives one rank no rows for its own experts (local-first: nothing
local to compute). A separate check counts the exchanges in flight while the experts compute,
forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import Tensor

from hyperparallel.models.families import FamilyPlan
from hyperparallel.models.hf import CausalLM
from hyperparallel.models.moe import MoEConfig, MoEFeedForward
from hyperparallel.parallel.all_to_all import PendingExchange
from hyperparallel.parallel.expert import (
    ExpertDispatchConfig,
    ExpertParallelDispatch,
    apply_expert_parallel,
)
from hyperparallel.parallel.hf_expert import apply_hf_expert_parallel, expert_modules
from hyperparallel.parallel.mesh import MeshSet, parse_mesh
from npu_core.dist import launch
from packages.hyperparallel.tests.tiny_hf import TINY_HF_SHAPE

pytestmark = pytest.mark.distributed

WORLD = 2
CFG = MoEConfig(dim=16, n_layers=1, n_heads=2, n_experts=8, top_k=2, ffn_dim=12, max_seq_len=8)
DISPATCHES = {
    "chunks=1": ExpertDispatchConfig(chunks=1),
    "chunks=2": ExpertDispatchConfig(chunks=2),
    "chunks=3": ExpertDispatchConfig(chunks=3),
    "chunks=4": ExpertDispatchConfig(chunks=4),
    "local_first": ExpertDispatchConfig(local_first=True),
}
"""Blocking; groups of 2; groups of 2, 1, 1; one expert per chunk; local rows first."""
CHOICES = (
    [0, 2, 3, 4, 5, 6, 6, 6, 8],  # rank 0: never expert 1 or 7
    [3, 4, 5, 6, 6, 6, 7, 7, 8],  # rank 1: never 0, 1 or 2; expert 1 gets no token at all
)
NO_LOCAL_CHOICES = (
    [4, 5, 5, 7, 8],  # rank 0 holds experts 0-3 and routes nothing to them
    [0, 3, 3, 6, 8],  # rank 1: local and remote; experts 1, 2 get no token at all
)
ROUTINGS = {
    "uneven": (CHOICES, tuple(DISPATCHES)),
    "no local rows on rank 0": (NO_LOCAL_CHOICES, ("chunks=1", "local_first")),
}
"""Per routing, its per-rank choices and the dispatches run on it."""
HF_EXTRA = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
EXPERTS_ONLY = FamilyPlan(
    "experts-only", (), "moe", layers="experts", experts=r"^experts\.(?:gate_up_proj|down_proj)$"
)
"""A plan for an experts module alone (held in a ModuleDict under ``experts``)."""


def _routed(dim: int, routing: str) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per rank: tokens ``[T, dim]`` (T differs per rank), top-2 experts drawn from the rank's
    choices of ``routing`` (8 is the skip sentinel), router weights and an output gradient."""
    gen = torch.Generator().manual_seed(11)
    routed = []
    for rank, choices in enumerate(ROUTINGS[routing][0]):
        tokens = 6 + 5 * rank
        pick = torch.randint(len(choices), (tokens, 2), generator=gen)
        routed.append(
            (
                torch.randn(tokens, dim, generator=gen),
                torch.tensor(choices)[pick],
                torch.rand(tokens, 2, generator=gen),
                torch.randn(tokens, dim, generator=gen),
            )
        )
    return routed


def _hf_experts() -> torch.nn.Module:
    """Qwen3-MoE's experts module alone with 8 experts, random weights (seeded)."""
    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(**{**TINY_HF_SHAPE, **HF_EXTRA})
    model = transformers.AutoModelForCausalLM.from_config(config)
    (_, module), *_ = expert_modules(model, CausalLM(model).plan)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.2)
    return module


def _backward(out: Tensor, grad: Tensor, *inputs: Tensor) -> list[Tensor]:
    (out * grad).sum().backward()
    return [t.grad.clone() for t in inputs]


def _full(t: Any) -> Tensor:
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def _dispatched_rank() -> dict[tuple[str, str, str], list[Tensor]]:
    """Per (model kind, routing, dispatch), this rank's (output, token grad, router-weight grad,
    expert grads) for the built-in MoE layer and for the transformers experts module."""
    rank = dist.get_rank()
    meshes = parse_mesh("ep=2", WORLD).build("cpu")
    results: dict[tuple[str, str, str], list[Tensor]] = {}
    for routing, (_, dispatches) in ROUTINGS.items():
        for name in dispatches:
            config = DISPATCHES[name]
            torch.manual_seed(0)
            ffn = MoEFeedForward(CFG)
            apply_expert_parallel(ffn, meshes, config)
            x, idx, w, g = (t.clone() for t in _routed(CFG.dim, routing)[rank])
            x.requires_grad_(), w.requires_grad_()
            assert ffn.dispatch is not None
            out = ffn.dispatch(ffn, x, idx, w)
            grads = _backward(out, g, x, w)
            experts = [_full(getattr(ffn, n).grad) for n in ("w_gate", "w_up", "w_down")]
            results["builtin", routing, name] = [out.detach(), *grads, *experts]

            module = _hf_experts()
            wrapper = torch.nn.ModuleDict({"experts": module})
            apply_hf_expert_parallel(wrapper, EXPERTS_ONLY, meshes, config)
            x, idx, w, g = (t.clone() for t in _routed(TINY_HF_SHAPE["hidden_size"], routing)[rank])
            x.requires_grad_(), w.requires_grad_()
            out = module(x, idx, w)
            grads = _backward(out, g, x, w)
            experts = [_full(p.grad) for p in module.parameters()]
            results["hf", routing, name] = [out.detach(), *grads, *experts]
    return results


def _reference(module: torch.nn.Module, forward: Any, dim: int, routing: str) -> list[list[Tensor]]:
    """Per rank, the single-process layer on that rank's tokens: (output, token grad,
    router-weight grad), then the expert grads averaged over the ranks (the data-parallel mean)."""
    module.zero_grad(set_to_none=True)
    per_rank = []
    for x, idx, w, g in _routed(dim, routing):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = forward(x, idx, w)
        per_rank.append([out.detach(), *_backward(out, g, x, w)])
    experts = [p.grad / WORLD for p in module.parameters() if p.grad is not None]
    return [[*ranked, *experts] for ranked in per_rank]


def test_every_dispatch_equals_single_process():
    """The built-in MoE layer and the transformers experts module, chunks 1 to 4 and
    local-first, on both routings: outputs, token and router-weight gradients and the mean
    expert gradients equal the single-process layer's (built-in: its own loop over experts;
    transformers: the library's eager forward)."""
    torch.manual_seed(0)
    ffn = MoEFeedForward(CFG)
    library = _hf_experts()
    library.config._experts_implementation = "eager"
    want = {}
    for routing in ROUTINGS:
        want["builtin", routing] = _reference(ffn, ffn._local_experts, CFG.dim, routing)
        hidden = TINY_HF_SHAPE["hidden_size"]
        want["hf", routing] = _reference(library, library, hidden, routing)
    assert len(want["builtin", "uneven"][0]) == 6 and len(want["hf", "uneven"][0]) == 5
    for rank, results in enumerate(launch(_dispatched_rank, WORLD, timeout=280)):
        assert len(results) == 2 * sum(len(names) for _, names in ROUTINGS.values())
        for (kind, routing, name), got in results.items():
            expected = want[kind, routing][rank]
            assert len(got) == len(expected)
            for i, (value, reference) in enumerate(zip(got, expected, strict=True)):
                torch.testing.assert_close(
                    value, reference, rtol=1e-5, atol=1e-6, msg=f"{kind} {routing} {name} #{i}"
                )


@contextmanager
def _count_in_flight() -> Iterator[list[int]]:
    """Track how many exchanges are launched and not yet waited for (``count[0]``)."""
    count = [0]
    launch_, wait = PendingExchange.launch, PendingExchange.wait

    def counted_launch(self: PendingExchange, *args: Any) -> None:
        launch_(self, *args)
        count[0] += 1

    def counted_wait(self: PendingExchange) -> Tensor:
        count[0] -= 1
        return wait(self)

    PendingExchange.launch, PendingExchange.wait = counted_launch, counted_wait  # type: ignore[method-assign]
    try:
        yield count
    finally:
        PendingExchange.launch, PendingExchange.wait = launch_, wait  # type: ignore[method-assign]


def _in_flight(meshes: MeshSet, name: str) -> dict[str, list[int]]:
    """The exchanges in flight while each expert call runs, in forward and (when the gradient
    of its rows is ready) in backward, for one dispatch."""
    x, idx, w, g = _routed(CFG.dim, "uneven")[dist.get_rank()]
    dispatch = ExpertParallelDispatch(meshes, CFG.n_experts, DISPATCHES[name])
    scale = dispatch.chunk_experts(torch.linspace(0.5, 2.0, dispatch.n_local))
    record: dict[str, list[int]] = {"forward": [], "backward": []}
    with _count_in_flight() as count:

        def compute(rows: Tensor, ids: Tensor, chunk: int, _: list[int]) -> Tensor:
            record["forward"].append(count[0])
            rows.register_hook(lambda grad: record["backward"].append(count[0]))
            return rows * scale[chunk][ids, None]

        tokens = x.clone().requires_grad_()
        (dispatch.dispatch(tokens, idx, w, compute) * g).sum().backward()
        assert count[0] == 0
    return record


def _in_flight_rank() -> dict[str, dict[str, list[int]]]:
    meshes = parse_mesh("ep=2", WORLD).build("cpu")
    return {name: _in_flight(meshes, name) for name in ("chunks=1", "chunks=4", "local_first")}


def test_exchanges_are_in_flight_while_experts_compute():
    """chunks=4: while each chunk computes, forward and backward, the other chunks' exchanges
    are in flight (3 of them: later chunks' tokens, earlier chunks' outputs). local_first: the
    local rows compute while the remote rows travel, and their backward while the remote rows'
    gradients return; the received rows compute with nothing in flight (forward: local call
    first; backward: received rows' gradient first). chunks=1, the blocking dispatch, computes
    with nothing in flight."""
    for seen in launch(_in_flight_rank, WORLD, timeout=120):
        assert seen["chunks=1"] == {"forward": [0], "backward": [0]}
        assert seen["chunks=4"] == {"forward": [3, 3, 3, 3], "backward": [3, 3, 3, 3]}
        assert seen["local_first"] == {"forward": [1, 0], "backward": [0, 1]}
