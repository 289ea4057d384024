"""Expert dispatch overlap: the EP step over the FSDP step, blocking, chunked and local-first, 2 CPU
ranks.

One Qwen3-MoE (transformers) model at Qwen3-30B-A3B's expert proportions, scaled down: 128
experts, top-8, expert width 3/8 of the hidden size (768 / 2048 there), 2 decoder blocks, small
vocabulary. Each rank builds the same model (same seed) once per variant and trains every copy
on the same batches, one step each, the order rotated every step so that load from other jobs
hits all alike:

- ``FSDP``: FSDP2 over both ranks, experts sharded on E and all-gathered per block;
- ``EP, chunks=1``: ``ep=2``, the blocking dispatch (exchange all tokens, compute, exchange
  back);
- ``EP, chunks=C``: ``ep=2``, the local experts in C groups; group c computes while the later
  groups' tokens travel and the earlier groups' outputs return, in forward and backward;
- ``EP, local first``: ``ep=2``, the rows a rank routes to its own experts stay out of the
  exchanges and compute while the other rows travel (backward: while their gradients return).

The optimizer is torch's AdamW on every parameter for every variant: the dispatch does not
change its cost, and Muon's Newton-Schulz would add the same time to every row and dilute the
ratios. A step is forward, backward and optimizer step, timed on the slowest rank.

Sizes: expert parallelism is worth its all-to-alls when the experts FSDP would gather each step
outweigh the tokens EP moves. Per block FSDP all-gathers ``E x 3 x H x I / 2`` expert weights
per rank in forward and again in backward and reduce-scatters as many gradients, while EP sends
``T x k x H / 2`` token rows per rank per exchange, four exchanges per block (dispatch and
combine, forward and backward). At the defaults (T = 512 tokens per rank, k = 8, E = 128,
I = 96) that is 18,432 weight rows of width H against 2,048 token rows per exchange: the
experts do not fit one rank's share comfortably, as at full size.

    uv run python packages/hyperparallel/benchmarks/expert_overlap.py --out DIR
        [--steps 64] [--warmup 2] [--batch 4] [--seq 128] [--chunks 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

from hyperparallel.models.hf import CausalLM
from hyperparallel.models.parallelize import apply_fsdp
from hyperparallel.parallel.expert import ExpertDispatchConfig
from hyperparallel.parallel.hf_expert import apply_hf_expert_parallel
from hyperparallel.parallel.mesh import MeshSet, parse_mesh
from npu_core.bench import BenchTable
from npu_core.dist import launch

WORLD = 2
SHAPE: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 96,
    "tie_word_embeddings": False,
}
ADAMW: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1}


class _Variant:
    """One model copy on its layout, with its optimizer."""

    def __init__(self, name: str, meshes: MeshSet, dispatch: ExpertDispatchConfig | None) -> None:
        self.name = name
        torch.manual_seed(0)  # the same initial weights in every variant and on every rank
        config = transformers.Qwen3MoeConfig(**SHAPE)
        self.model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
        self.aux_coef = float(config.router_aux_loss_coef)
        placed: set[nn.Parameter] = set()
        if dispatch is not None:
            placed = set(
                apply_hf_expert_parallel(self.model.model, self.model.plan, meshes, dispatch)
            )
        apply_fsdp(self.model, meshes.dense, placed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step; this rank's loss."""
        ce, aux = self.model(tokens, targets)
        loss = ce + self.aux_coef * aux
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def _batch(step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s batch (the same for every variant)."""
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    seqs = torch.randint(SHAPE["vocab_size"], (batch, seq + 1), generator=gen)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def _rank(settings: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)  # 2 ranks share the 2 cores
    fsdp = parse_mesh("fsdp", WORLD).build("cpu")
    ep = parse_mesh("ep=2", WORLD).build("cpu")
    variants = [_Variant("FSDP", fsdp, None)]
    variants += [
        _Variant(f"EP, chunks={c}", ep, ExpertDispatchConfig(chunks=c)) for c in settings["chunks"]
    ]
    variants.append(_Variant("EP, local first", ep, ExpertDispatchConfig(local_first=True)))
    results = {v.name: {"time": [], "loss": []} for v in variants}
    for step in range(settings["warmup"] + settings["steps"]):
        tokens, targets = _batch(step, settings["batch"], settings["seq"])
        shift = step % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            dist.barrier()
            began = time.perf_counter()
            loss = variant.step(tokens, targets)
            slowest = torch.tensor([time.perf_counter() - began, loss])
            dist.all_reduce(slowest[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(slowest[1:])
            record = results[variant.name]
            record["loss"].append(slowest[1].item() / WORLD)
            if step >= settings["warmup"]:
                record["time"].append(slowest[0].item())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=64, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if 1 not in args.chunks:
        parser.error("--chunks must include 1 (the blocking dispatch every ratio refers to)")
    settings = {k: getattr(args, k) for k in ("steps", "warmup", "batch", "seq", "chunks")}
    tokens = args.batch * args.seq
    table = BenchTable(
        f"Qwen3-MoE (128 experts, top-8, hidden 256, expert width 96, 2 blocks) on {WORLD} CPU "
        f"ranks, {tokens} tokens per rank: step time (median of {args.steps} interleaved steps, "
        "slowest rank)",
        ["variant", "step ms", "EP / FSDP", "vs chunks=1", "first loss"],
        metadata={**settings, "shape": SHAPE, "adamw": ADAMW},
    )
    results = launch(_rank, WORLD, settings, timeout=3600)[0]
    fsdp = results["FSDP"]["time"]
    blocking = results["EP, chunks=1"]["time"]
    for name, record in results.items():
        times = record["time"]
        ep = name != "FSDP"
        table.add(
            variant=name,
            **{
                "step ms": statistics.median(times) * 1e3,
                # medians of per-step ratios: both sides of a step share the machine's load
                "EP / FSDP": statistics.median(t / f for t, f in zip(times, fsdp, strict=True))
                if ep
                else None,
                "vs chunks=1": statistics.median(
                    t / b for t, b in zip(times, blocking, strict=True)
                )
                if ep
                else None,
                "first loss": record["loss"][0],
            },
        )
    _, md_path = table.write(args.out, "expert_overlap")
    print(md_path.read_text())


if __name__ == "__main__":
    main()
