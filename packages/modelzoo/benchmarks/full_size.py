"""A card at its published size on 2 ranks: hyperparallel's job against plain FSDP2 with
torch.optim.AdamW and with torch.optim.Muon, side by side in one run.

Usage: python packages/modelzoo/benchmarks/full_size.py --out DIR [--card qwen3-0.6b]
    [--layers N] [--steps 4] [--rounds 2] [--seq-len 256] [--global-batch 2] [--mesh fsdp]
    [--dtype fp32]

The model is what ``modelzoo train CARD --full-size [--layers N]`` trains: the card's published
config, random weights from seed 0, bytes of the Python stdlib as tokens. Three variants, each
on 2 fresh ranks, one after another in a round, the order reversed every other round, so that
load from other jobs hits all of them alike:

- ``hyperparallel``: the job itself on ``--mesh`` (FSDP2 per decoder block, experts placed
  first under ``ep``, Muon on hidden matrices de-duplicated over the ranks, AdamW on the
  rest), its own step records.
- ``FSDP2 + AdamW``: torch's ``fully_shard`` per decoder block and the root, the same way,
  and ``torch.optim.AdamW`` on every parameter.
- ``FSDP2 + torch Muon``: the same with ``torch.optim.Muon`` on the matrices hyperparallel routes
  to Muon that are 2-D (torch's Muon takes only 2-D parameters, so a MoE's ``[E, M, N]``
  expert stacks go to AdamW there). Muon takes the FSDP2 DTensor shards as they
  are: DTensor redistributes the shards for its Newton-Schulz matmuls, and its update equals the
  unsharded one, so no gather is added.

The plain variants run the same wrapped model (hyperparallel's ``CausalLM``: chunked
cross-entropy, logits never materialised) on the same batches, so first losses agree and the
optimizer, not the loss, is what differs. Per variant: medians over the steps after the first
(step = forward + backward + optimizer, rank 0's clock), each rank's peak memory of a step
(device peak allocated, on CPU the rank's peak resident set), and step-time and peak ratios
against FSDP2 + AdamW (medians of per-round ratios). The job's final checkpoint is skipped: it is
not part of a step. ``--dtype bf16`` builds every variant's model in bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from npu_core.bench import BenchTable
from npu_core.dist import launch
from torchmind_modelzoo import registry
from torchmind_modelzoo.env import force_offline
from torchmind_modelzoo.options import TrainOptions
from torchmind_modelzoo.training import train_config, write_model_config

force_offline()

BASELINE = "FSDP2 + AdamW"
VARIANTS = {
    "hyperparallel": "Muon (de-duplicated) + AdamW",
    BASELINE: "torch.optim.AdamW",
    "FSDP2 + torch Muon": "torch.optim.Muon + AdamW",
}


def job_config(args: argparse.Namespace, folder: Path) -> Any:
    """hyperparallel's TrainConfig of ``modelzoo train CARD --full-size`` with these sizes."""
    card = registry.get(args.card)
    job = {
        "steps": args.steps,
        "out_dir": str(folder),
        "data": {"seq_len": args.seq_len, "global_batch_size": args.global_batch},
        "eval_every": args.steps,
        "eval_batches": 1,
        "checkpoint_every": args.steps,
        "optim": {"warmup_steps": 1},
        "parallel": {"nproc": 2, "mesh": args.mesh},
        "dtype": args.dtype,
    }
    options = TrainOptions(full_size=True, layers=args.layers, job=job)
    return train_config(card, options, write_model_config(card, options, folder / "model"))


def _hyperparallel_rank(cfg: Any) -> list[dict[str, Any]]:
    """The job's own loop; its step records (every rank's peak in each)."""
    import json

    import torch.distributed as dist

    from hyperparallel.train import checkpoint, trainer

    checkpoint.save = lambda *a, **k: None  # the last step's checkpoint is not part of a step
    trainer.train_rank(cfg, False)
    if dist.get_rank() != 0:
        return []
    records: list[dict[str, Any]] = json.loads(Path(cfg.out_dir, "metrics.json").read_text())[
        "train"
    ]
    return [
        {
            "step_ms": r["backward_ms"] + r["optim_ms"],
            "backward_ms": r["backward_ms"],
            "optim_ms": r["optim_ms"],
            "peak_mb": r["peak_memory_mb"],
            "loss": r["loss"],
        }
        for r in records
    ]


def _optimizers(lm: Any, variant: str, cfg: Any) -> list[torch.optim.Optimizer]:
    """AdamW on everything, or torch's Muon on the matrices hyperparallel routes to Muon and
    AdamW on the rest (the same learning rates and weight decay as the job)."""
    optim = cfg.optim
    params = list(lm.named_parameters())
    if variant == BASELINE:
        adamw = [p for _, p in params]
        return [torch.optim.AdamW(adamw, lr=optim.adamw_lr, weight_decay=optim.weight_decay)]
    muon = [p for name, p in params if lm.classify(name, p) == "muon" and p.ndim == 2]
    rest = [p for name, p in params if lm.classify(name, p) != "muon" or p.ndim != 2]
    return [
        torch.optim.Muon(muon, lr=optim.muon_lr, weight_decay=optim.weight_decay),
        torch.optim.AdamW(rest, lr=optim.adamw_lr, weight_decay=optim.weight_decay),
    ]


def _plain_rank(cfg: Any, variant: str) -> list[dict[str, Any]]:
    """FSDP2 as a user writes it: ``fully_shard`` per block, then the root; torch optimizers."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hyperparallel.models.hf import build_causal_lm
    from hyperparallel.train.hf_model import TransformersSpec
    from npu_core.memory import memory_stats, reset_peak_memory_stats

    spec = TransformersSpec(cfg)
    data = spec.batches()
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = cfg.data.global_batch_size // world
    lm = build_causal_lm(spec.model.config, seed=cfg.seed, dtype=spec.dtype).train()
    for layer in lm.layers:
        fully_shard(layer)
    fully_shard(lm)
    optimizers = _optimizers(lm, variant, cfg)
    records = []
    for step in range(cfg.steps):
        reset_peak_memory_stats()
        began = time.perf_counter()
        inputs, targets = data.train_batch(step, rank, batch)
        loss, balance = lm(inputs, targets)
        (loss + cfg.optim.balance_weight * balance).backward()
        opt_began = time.perf_counter()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        done = time.perf_counter()
        peak = torch.tensor([memory_stats().peak_allocated_bytes / 2**20], dtype=torch.float64)
        peaks = [torch.empty_like(peak) for _ in range(world)]
        dist.all_gather(peaks, peak)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        records.append(
            {
                "step_ms": (done - began) * 1e3,
                "backward_ms": (opt_began - began) * 1e3,
                "optim_ms": (done - opt_began) * 1e3,
                "peak_mb": [p.item() for p in peaks],
                "loss": mean.item() / world,
            }
        )
    return records if rank == 0 else []


def run_variant(variant: str, cfg: Any) -> list[dict[str, Any]]:
    """One launch of 2 fresh ranks; rank 0's step records."""
    if variant == "hyperparallel":
        return launch(_hyperparallel_rank, 2, cfg, backend=None, timeout=3600)[0]
    return launch(_plain_rank, 2, cfg, variant, timeout=3600)[0]


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps after the first; each rank's median peak; the first loss."""
    timed = records[1:]
    out = {
        key: statistics.median(r[key] for r in timed)
        for key in ("step_ms", "backward_ms", "optim_ms")
    }
    out["peak_mb"] = [
        statistics.median(rank) for rank in zip(*(r["peak_mb"] for r in timed), strict=True)
    ]
    out["first_loss"] = records[0]["loss"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for full_size.{json,md}")
    parser.add_argument("--card", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--steps", type=int, default=4, help="per launch; the first warms up")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--mesh", default="fsdp", help="hyperparallel's mesh (e.g. ep=2)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--name", default="full_size", help="result file name")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (1 warm-up step + 1 measured), got {args.steps}")
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="full-size-") as tmp:
        for round_index in range(args.rounds):
            order = list(VARIANTS) if round_index % 2 == 0 else list(VARIANTS)[::-1]
            for variant in order:
                folder = Path(tmp) / f"{len(runs[variant])}-{variant.replace(' ', '')}"
                records = run_variant(variant, job_config(args, folder))
                runs[variant].append(summarise(records))
                print(variant, runs[variant][-1], flush=True)
    load_after = os.getloadavg()
    card = registry.get(args.card)
    published = (card.config or {}).get("num_hidden_layers")
    layers = f"{args.layers or published} of {published} layers"
    tokens = args.seq_len * args.global_batch
    table = BenchTable(
        f"{card.id} at its published size ({layers}, {args.dtype}), 2 CPU ranks "
        f"(hyperparallel on --mesh {args.mesh}), {tokens} tokens per step "
        f"(median of {args.rounds} round{'s' if args.rounds > 1 else ''} x steps 2-{args.steps})",
        [
            "variant",
            "optimizer",
            "step ms",
            "vs FSDP2 + AdamW",
            "forward+backward ms",
            "optimizer ms",
            "peak MiB rank 0",
            "peak MiB rank 1",
            "peak vs FSDP2 + AdamW",
            "first loss",
        ],
        metadata={
            "card": card.id,
            "layers": args.layers,
            "seq_len": args.seq_len,
            "global_batch": args.global_batch,
            "hyperparallel_mesh": args.mesh,
            "dtype": args.dtype,
            "steps": args.steps,
            "rounds": args.rounds,
            "load_average_1_5_15_before": [round(x, 2) for x in load_before],
            "load_average_1_5_15_after": [round(x, 2) for x in load_after],
        },
    )
    base = runs[BASELINE]
    for variant, optimizer in VARIANTS.items():
        rounds = runs[variant]
        paired = list(zip(rounds, base, strict=True))
        table.add(
            variant=variant,
            optimizer=optimizer,
            **{
                "step ms": statistics.median(r["step_ms"] for r in rounds),
                "vs FSDP2 + AdamW": statistics.median(
                    r["step_ms"] / b["step_ms"] for r, b in paired
                ),
                "forward+backward ms": statistics.median(r["backward_ms"] for r in rounds),
                "optimizer ms": statistics.median(r["optim_ms"] for r in rounds),
                "peak MiB rank 0": statistics.median(r["peak_mb"][0] for r in rounds),
                "peak MiB rank 1": statistics.median(r["peak_mb"][1] for r in rounds),
                "peak vs FSDP2 + AdamW": statistics.median(
                    max(r["peak_mb"]) / max(b["peak_mb"]) for r, b in paired
                ),
                "first loss": rounds[0]["first_loss"],
            },
        )
    _, md_path = table.write(args.out, args.name)
    print(md_path.read_text())


if __name__ == "__main__":
    main()
