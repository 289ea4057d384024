"""Chunked, overlapped expert dispatch on 2 gloo ranks (ep=2, 4 local experts per rank).

Every chunk count gives the outputs and gradients of the single-process layer (and so of the
blocking dispatch, chunks=1), with uneven loads: one expert receives no tokens from any rank,
one rank sends nothing to some experts, and some slots carry the skip sentinel. A separate check
counts the exchanges in flight while each chunk's experts compute, forward and backward.
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
CHUNKS = (1, 2, 3, 4)
"""Blocking; groups of 2; groups of 2, 1, 1; one expert per chunk."""
CHOICES = (
    [0, 2, 3, 4, 5, 6, 6, 6, 8],  # rank 0: never expert 1 or 7
    [3, 4, 5, 6, 6, 6, 7, 7, 8],  # rank 1: never 0, 1 or 2; expert 1 gets no token at all
)
HF_EXTRA = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
EXPERTS_ONLY = FamilyPlan(
    "experts-only", (), "moe", layers="experts", experts=r"^experts\.(?:gate_up_proj|down_proj)$"
)
"""A plan for an experts module alone (held in a ModuleDict under ``experts``)."""


def _routed(dim: int) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per rank: tokens ``[T, dim]`` (T differs per rank), top-2 experts drawn from the rank's
    choices (8 is the skip sentinel), router weights and an output gradient."""
    gen = torch.Generator().manual_seed(11)
    routed = []
    for rank, choices in enumerate(CHOICES):
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


def _chunked_rank() -> dict[str, dict[int, list[Tensor]]]:
    """Per chunk count, this rank's (output, token grad, router-weight grad, expert grads) for
    the built-in MoE layer and for the transformers experts module."""
    rank = dist.get_rank()
    meshes = parse_mesh("ep=2", WORLD).build("cpu")
    results: dict[str, dict[int, list[Tensor]]] = {"builtin": {}, "hf": {}}
    for chunks in CHUNKS:
        config = ExpertDispatchConfig(chunks=chunks)
        torch.manual_seed(0)
        ffn = MoEFeedForward(CFG)
        apply_expert_parallel(ffn, meshes, config)
        x, idx, w, g = (t.clone() for t in _routed(CFG.dim)[rank])
        x.requires_grad_(), w.requires_grad_()
        assert ffn.dispatch is not None
        out = ffn.dispatch(ffn, x, idx, w)
        grads = _backward(out, g, x, w)
        experts = [_full(getattr(ffn, n).grad) for n in ("w_gate", "w_up", "w_down")]
        results["builtin"][chunks] = [out.detach(), *grads, *experts]

        module = _hf_experts()
        wrapper = torch.nn.ModuleDict({"experts": module})
        apply_hf_expert_parallel(wrapper, EXPERTS_ONLY, meshes, config)
        x, idx, w, g = (t.clone() for t in _routed(TINY_HF_SHAPE["hidden_size"])[rank])
        x.requires_grad_(), w.requires_grad_()
        out = module(x, idx, w)
        grads = _backward(out, g, x, w)
        experts = [_full(p.grad) for p in module.parameters()]
        results["hf"][chunks] = [out.detach(), *grads, *experts]
    return results


def _reference(module: torch.nn.Module, forward: Any, dim: int) -> list[list[Tensor]]:
    """Per rank, the single-process layer on that rank's tokens: (output, token grad,
    router-weight grad), then the expert grads averaged over the ranks (the data-parallel mean)."""
    per_rank = []
    for x, idx, w, g in _routed(dim):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = forward(x, idx, w)
        per_rank.append([out.detach(), *_backward(out, g, x, w)])
    experts = [p.grad / WORLD for p in module.parameters() if p.grad is not None]
    return [[*ranked, *experts] for ranked in per_rank]


def test_chunked_dispatch_equals_single_process_for_every_chunk_count():
    """The built-in MoE layer and the transformers experts module, chunks 1 to 4: outputs, token
    and router-weight gradients and the mean expert gradients equal the single-process layer's
    (built-in: its own loop over experts; transformers: the library's eager forward)."""
    torch.manual_seed(0)
    ffn = MoEFeedForward(CFG)
    builtin = _reference(ffn, ffn._local_experts, CFG.dim)
    library = _hf_experts()
    library.config._experts_implementation = "eager"
    hf = _reference(library, library, TINY_HF_SHAPE["hidden_size"])
    assert len(builtin[0]) == 6 and len(hf[0]) == 5
    for rank, results in enumerate(launch(_chunked_rank, WORLD, timeout=280)):
        for name, want in (("builtin", builtin), ("hf", hf)):
            for chunks, got in results[name].items():
                assert len(got) == len(want[rank])
                for i, (value, expected) in enumerate(zip(got, want[rank], strict=True)):
                    torch.testing.assert_close(
                        value, expected, rtol=1e-5, atol=1e-6, msg=f"{name} chunks={chunks} #{i}"
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


def _in_flight(meshes: MeshSet, chunks: int) -> dict[str, list[int]]:
    """The exchanges in flight while each chunk's experts run, in forward and (when the gradient
    of the chunk's rows is ready) in backward, for one chunk count."""
    x, idx, w, g = _routed(CFG.dim)[dist.get_rank()]
    dispatch = ExpertParallelDispatch(meshes, CFG.n_experts, ExpertDispatchConfig(chunks=chunks))
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


def _in_flight_rank() -> dict[int, dict[str, list[int]]]:
    meshes = parse_mesh("ep=2", WORLD).build("cpu")
    return {chunks: _in_flight(meshes, chunks) for chunks in (1, 4)}


def test_exchanges_are_in_flight_while_chunks_compute():
    """chunks=4: while each chunk computes, forward and backward, the other chunks' exchanges
    are in flight (3 of them: later chunks' tokens, earlier chunks' outputs). chunks=1, the
    blocking dispatch, computes with nothing in flight."""
    for seen in launch(_in_flight_rank, WORLD, timeout=120):
        assert seen[1] == {"forward": [0], "backward": [0]}
        assert seen[4] == {"forward": [3, 3, 3, 3], "backward": [3, 3, 3, 3]}
