"""Activation policies on real gloo ranks: early recompute in a 2-stage 1F1B pipeline, and
checkpointed FSDP2 blocks; gradients equal the un-checkpointed reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from hyperparallel.activation import EarlyRecompute1F1B, SwapSchedule, checkpoint_wrapper
from hyperparallel.models.moe import MoEConfig, MoETransformer
from hyperparallel.models.parallelize import apply_activation_memory, apply_fsdp
from hyperparallel.parallel.mesh import ParallelDims
from npu_core.dist import launch

pytestmark = pytest.mark.distributed

MICRO_BATCHES = 4


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(4))
    )


def _pipeline_rank() -> dict:
    rank = dist.get_rank()
    full = _blocks()
    stage_module = copy.deepcopy(full[2 * rank : 2 * rank + 2])
    for block in stage_module:
        checkpoint_wrapper(block, "selective")
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    schedule = EarlyRecompute1F1B(stage, MICRO_BATCHES, loss_fn=F.mse_loss)
    torch.manual_seed(1)
    x, target = torch.randn(8, 16), torch.randn(8, 16)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=target)
    out = full(x)
    loss = sum(
        F.mse_loss(o, t)
        for o, t in zip(out.chunk(MICRO_BATCHES), target.chunk(MICRO_BATCHES), strict=True)
    )
    (loss / MICRO_BATCHES).backward()
    want = [p.grad for p in full[2 * rank : 2 * rank + 2].parameters()]
    got = [p.grad for p in stage_module.parameters()]
    return {
        "max_diff": max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)),
        "early": schedule.early_recomputes,
        "recomputes": [h.recomputes for h in schedule.recomputed_handles],
        "done": all(h.done for h in schedule.recomputed_handles),
    }


def test_pipeline_1f1b_recomputes_each_micro_batch_early_once():
    """2 stages x 4 micro-batches: every micro-batch recomputed before its backward, once."""
    for result in launch(_pipeline_rank, 2, timeout=120):
        assert result["max_diff"] <= 1e-6
        assert result["early"] == list(range(MICRO_BATCHES))
        assert result["recomputes"] == [1] * (2 * MICRO_BATCHES)  # 2 blocks per stage
        assert result["done"]


def _fsdp_rank() -> float:
    torch.manual_seed(0)
    cfg = MoEConfig(dim=32, n_layers=2, n_heads=2, n_experts=4, ffn_dim=32, max_seq_len=32)
    reference = MoETransformer(cfg)
    model = copy.deepcopy(reference)
    apply_activation_memory(
        model, ["selective_swap", "recompute"], swap_inputs=True, swap_threshold_bytes=0
    )
    mesh = ParallelDims(dp_shard=2).build("cpu").dense
    apply_fsdp(reference, mesh)
    apply_fsdp(model, mesh)
    torch.manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, 256, (2, 32))
    logits, balance = reference(tokens)
    (logits.square().mean() + balance).backward()
    with SwapSchedule(offload_after=1, prefetch_ahead=1, recompute_ahead=1):
        logits, balance = model(tokens)
    (logits.square().mean() + balance).backward()
    return max(
        (a.grad.to_local() - b.grad.to_local()).abs().max().item()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


def test_fsdp2_checkpointed_blocks_match_reference_gradients():
    """fully_shard blocks with swap, swapped inputs and early recompute: same gradient shards."""
    assert max(launch(_fsdp_rank, 2, timeout=120)) <= 1e-6
