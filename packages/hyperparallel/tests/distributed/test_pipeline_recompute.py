"""Early recompute in a pipeline schedule that pairs one micro-batch's backward with another's
forward (torch's ScheduleDualPipeV, OVERLAP_F_B actions), on 2 gloo ranks x 2 stages each."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

from hyperparallel.activation import EarlyRecomputeDualPipeV, PairedRecompute, checkpoint_wrapper
from npu_core.dist import launch

MICRO_BATCHES = 6
STAGES = 4  # V layout on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
RANK_STAGES = {0: (0, 3), 1: (1, 2)}


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(STAGES))
    )


def _run(variant: str) -> dict:
    rank = dist.get_rank()
    full = _blocks()
    modules = {s: copy.deepcopy(full[s]) for s in RANK_STAGES[rank]}
    if variant != "none":
        for module in modules.values():
            checkpoint_wrapper(module, "selective")  # LayerNorm and GELU recomputed
    stages = [PipelineStage(m, s, STAGES, torch.device("cpu")) for s, m in modules.items()]
    kind = EarlyRecomputeDualPipeV if variant == "early" else ScheduleDualPipeV
    schedule = kind(stages, MICRO_BATCHES, loss_fn=F.mse_loss)
    torch.manual_seed(1)
    x, target = torch.randn(12, 16), torch.randn(12, 16)
    if rank == 0:
        schedule.step(x, target=target)
    else:
        schedule.step()
    out = full(x)
    loss = sum(
        F.mse_loss(o, t)
        for o, t in zip(out.chunk(MICRO_BATCHES), target.chunk(MICRO_BATCHES), strict=True)
    )
    (loss / MICRO_BATCHES).backward()
    diff = max(
        (a.grad - b.grad).abs().max().item()
        for s, m in modules.items()
        for a, b in zip(m.parameters(), full[s].parameters(), strict=True)
    )
    result: dict = {"max_diff": diff}
    if variant == "early":
        hook: PairedRecompute = schedule.recompute
        result.update(
            events=list(hook.events),
            pairs=dict(hook.pairs),
            early=list(hook.early_recomputes),
            recomputes=[h.recomputes for h in hook.recomputed_handles],
            done=all(h.done for h in hook.recomputed_handles),
        )
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["none", "backward"])
def test_dualpipev_gradients_equal_unpipelined_reference(variant):
    """No recompute and recompute inside backward: gradients of the whole model's."""
    for result in launch(_run, 2, variant, timeout=180):
        assert result["max_diff"] <= 1e-6


@pytest.mark.distributed
def test_dualpipev_recomputes_each_paired_backward_before_its_forward():
    """Early paired recompute: same gradients; every pair's backward micro-batch recomputed
    right before the paired forward, once, its backward later; nothing else early."""
    for result in launch(_run, 2, "early", timeout=180):
        assert result["max_diff"] <= 1e-6
        events, pairs = result["events"], result["pairs"]
        assert pairs, "DualPipeV with 6 micro-batches pairs forwards with backwards"
        assert sorted(result["early"]) == sorted(set(pairs.values()))
        for forward, backward in pairs.items():
            f = events.index(("F", *forward))
            r = events.index(("R", *backward))
            assert r == f - 1, (forward, backward, events[r : f + 1])
            done = [i for i, e in enumerate(events) if e[0] in "BI" and tuple(e[1:]) == backward]
            assert done and done[0] > f
        assert result["recomputes"] == [1] * len(result["recomputes"]) and result["recomputes"]
        assert result["done"]
