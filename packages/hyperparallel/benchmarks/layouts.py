"""``hyperparallel train`` per mesh layout on 4 local ranks: speed, optimizer, activations, NS work.

Same model, seed and global batch for every layout (the default model with 4 blocks, global batch
16 x 128 tokens, fp32 Newton-Schulz). Each layout is one ``train_rank`` launch of ``--steps``
steps (the first two are warm-up); the layouts run one after another within a round, the order
reversed every other round, ``--rounds`` rounds, so that load from other jobs on the machine hits
every layout alike. Reported per layout:

- tokens/s, forward+backward ms and optimizer ms: rank 0's ``metrics.json`` (the job's own
  numbers), median over rounds of each round's median; ``vs first row`` is the median of per-round
  ratios against the first row (FSDP).
- saved activations: ``saved MiB / step`` is the trainer's own count (``saved_device_mb``: every
  storage autograd saved during the step, counted once, all micro-batches together);
  ``peak live saved MiB`` is the most saved-for-backward bytes alive at one time, from a
  saved-tensor hook around the trainer (storages counted once, released when autograd frees
  them; weights excluded). Under pipeline schedules the two differ: micro-batches whose backward
  has run free theirs before later ones save. Both are the maximum over ranks.
- Newton-Schulz FLOPs: every matrix each rank's NS kernel receives is counted (5 iterations of
  ``4 m^2 n + 2 m^3``, ``m <= n``); ``NS / job total`` is the sum over ranks divided by the
  model's own total (computed from its parameters, so 1.0 means each matrix, dense or expert,
  was orthogonalised exactly once in the job) and ``max / even share`` the busiest rank over
  ``total / world`` (target <= 1.15).

``--ablation`` adds the paired-schedule rows (dualpipev with early recompute before the paired
forward, recompute inside backward, and none); ``--only-ablation`` runs just those.

    uv run python packages/hyperparallel/benchmarks/layouts.py --out DIR [--steps 5] [--rounds 1]
        [--full] [--ablation] [--world 8] [--layout NAME ...]

``--world 8`` runs a reduced set on 8 ranks (fsdp, hsdp 2x4, ep=4 x dp_shard=2, pp=2 x
dp_shard=4) with 8 experts per layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import weakref
from pathlib import Path
from typing import Any

import torch

from hyperparallel.activation.report import is_parameter_like
from hyperparallel.models.moe import MoETransformer
from hyperparallel.optim import newton_schulz
from hyperparallel.optim.hybrid import route_parameters
from hyperparallel.train.config import TrainConfig, load_config
from hyperparallel.train.presets import default
from hyperparallel.train.trainer import train_rank
from npu_core.bench import BenchTable
from npu_core.dist import launch

NS_STEPS = 5
LAYOUTS = [
    ("fsdp", "fsdp", []),
    ("hsdp 2x2", "dp_replicate=2,dp_shard=2", []),
    ("ep=2 x dp_shard=2", "ep=2,dp_shard=2", []),
    ("ep=4", "ep=4", []),
    ("pp=2 x dp_shard=2, 1f1b", "pp=2,dp_shard=2", ["parallel.pp_schedule='1f1b'"]),
    (
        "pp=2 x dp_shard=2, interleaved_1f1b",
        "pp=2,dp_shard=2",
        ["parallel.pp_schedule='interleaved_1f1b'"],
    ),
    ("pp=2 x dp_shard=2, dualpipev", "pp=2,dp_shard=2", ["parallel.pp_schedule='dualpipev'"]),
    ("pp=2 x ep=2, 1f1b", "pp=2,ep=2", ["parallel.pp_schedule='1f1b'"]),
]
DEFAULT_SET = {
    "fsdp",
    "hsdp 2x2",
    "ep=2 x dp_shard=2",
    "pp=2 x dp_shard=2, 1f1b",
    "pp=2 x dp_shard=2, dualpipev",
}
"""The default run (a few minutes): one layout of each kind; ``--full`` adds ep=4,
interleaved_1f1b and pp x ep."""
LAYOUTS_8 = [  # 8 ranks: 8 experts per MoE layer, so that ep x dp_shard = 8 divides them
    ("fsdp 8", "fsdp", []),
    ("hsdp 2x4", "dp_replicate=2,dp_shard=4", []),
    ("ep=4 x dp_shard=2", "ep=4,dp_shard=2", []),
    ("pp=2 x dp_shard=4, 1f1b", "pp=2,dp_shard=4", ["parallel.pp_schedule='1f1b'"]),
]
ABLATION = [
    ("dualpipev, no recompute", "pp=2,dp_shard=2", ["parallel.pp_schedule='dualpipev'"]),
    (
        "dualpipev, recompute in backward",
        "pp=2,dp_shard=2",
        ["parallel.pp_schedule='dualpipev'", "activation.policy='recompute'"],
    ),
    (
        "dualpipev, early recompute (paired)",
        "pp=2,dp_shard=2",
        [
            "parallel.pp_schedule='dualpipev'",
            "activation.policy='recompute'",
            "parallel.pp_early_recompute=true",
        ],
    ),
]


def ns_flops(rows: int, cols: int) -> int:
    """FLOPs of ``NS_STEPS`` Newton-Schulz iterations on one ``rows x cols`` matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * m * m * n + 2 * m**3)


def job_ns_flops(cfg: TrainConfig) -> int:
    """NS FLOPs of one step of the whole model when every Muon matrix is orthogonalised once."""
    model = MoETransformer(cfg.model)
    routes = route_parameters(model)
    total = 0
    for name, param in model.named_parameters():
        if routes[name] == "muon":
            experts = param.shape[0] if param.ndim == 3 else 1
            total += experts * ns_flops(param.shape[-2], param.shape[-1])
    return total


class LiveSavedBytes:
    """Saved-tensor hooks that track the saved-for-backward bytes alive at once, and the peak.

    A storage counts once however many saved tensors view it, from the first save until autograd
    has released every one of them (the packed handle is freed). Parameters are not counted. The
    trainer's own :class:`~hyperparallel.activation.ActivationTracker` hands saved tensors on to
    enclosing hooks, so this sees what the tracker sees outside checkpointed regions.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [saved handles alive, nbytes]

    def pack(self, tensor: torch.Tensor) -> Any:
        if is_parameter_like(tensor):
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [0, storage.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        handle = _Saved(tensor)
        weakref.finalize(handle, self._release, key)
        return handle

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[key]


class _Saved:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _rank(cfg: TrainConfig) -> dict[str, Any]:
    """One rank of the job, with its NS kernel's work and its live saved bytes counted."""
    counted = {"flops": 0, "matrices": 0}
    original = newton_schulz.orthogonalize

    def counting(matrices: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        for m in matrices:
            count = m.shape[0] if m.ndim == 3 else 1
            counted["matrices"] += count
            counted["flops"] += count * ns_flops(m.shape[-2], m.shape[-1])
        return original(matrices, *args, **kwargs)

    newton_schulz.orthogonalize = counting  # Muon calls it through the module attribute
    live = LiveSavedBytes()
    try:
        with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
            result = train_rank(cfg, False)
    finally:
        newton_schulz.orthogonalize = original
    return {
        "ns_flops_per_step": counted["flops"] / cfg.steps,
        "ns_matrices_per_step": counted["matrices"] / cfg.steps,
        "saved_device_bytes": result.activation.get("device_bytes", 0),
        "peak_live_saved_bytes": live.peak,
        "first_loss": result.train_losses[0],
    }


def _config(mesh: str, extra: list[str], folder: Path, steps: int, world: int) -> TrainConfig:
    eight = ["model.n_experts=8"] if world == 8 else []
    return load_config(
        default(),
        overrides=[
            f"out_dir={str(folder)!r}",
            f"parallel.mesh={mesh!r}",
            f"parallel.nproc={world}",
            f"steps={steps}",
            "model.n_layers=4",
            "data.global_batch_size=16",
            "parallel.microbatches=4",
            "optim.ns_dtype='fp32'",
            f"eval_every={steps}",
            "eval_batches=1",
            f"checkpoint_every={steps}",
            *eight,
            *extra,
        ],
    )


def run(mesh: str, extra: list[str], folder: Path, steps: int, world: int) -> dict[str, Any]:
    """Train one layout once; rank 0's metrics (steps after the first two) and every rank's
    counts."""
    cfg = _config(mesh, extra, folder, steps, world)
    ranks = launch(_rank, world, cfg, backend=None, timeout=1800)
    records = json.loads((folder / "metrics.json").read_text())["train"][2:]
    return {
        "tokens/s": statistics.median(r["tokens_per_s"] for r in records),
        "forward+backward ms": statistics.median(r["backward_ms"] for r in records),
        "optimizer ms": statistics.median(r["optim_ms"] for r in records),
        "ranks": ranks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5, help="per launch; the first 2 warm up")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--full", action="store_true", help="every 4-rank layout (default: a representative 5)"
    )
    parser.add_argument(
        "--world", type=int, default=4, choices=(4, 8), help="8: the 8-rank layouts instead"
    )
    parser.add_argument("--ablation", action="store_true", help="also the recompute ablation")
    parser.add_argument("--only-ablation", action="store_true")
    parser.add_argument(
        "--layout", action="append", default=[], help="run only these rows (repeatable)"
    )
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps must be >= 3 (2 warm-up steps + 1 measured), got {args.steps}")
    layouts = LAYOUTS if args.full else [c for c in LAYOUTS if c[0] in DEFAULT_SET]
    layouts = layouts if args.world == 4 else LAYOUTS_8
    extras = ABLATION if args.world == 4 else []
    cases = [] if args.only_ablation else list(layouts)
    cases += extras if args.ablation or args.only_ablation else []
    if args.layout:
        layouts = LAYOUTS if args.world == 4 else LAYOUTS_8
        known = [name for name, _, _ in layouts + extras]
        unknown = sorted(set(args.layout) - set(known))
        if unknown:
            parser.error(f"--layout {unknown}: unknown at --world {args.world}; known: {known}")
        cases = [case for case in layouts + extras if case[0] in args.layout]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cases}
    for round_index in range(args.rounds):
        order = cases if round_index % 2 == 0 else cases[::-1]
        for name, mesh, extra in order:
            slug = name.replace(" ", "_").replace(",", "").replace("=", "")
            folder = args.out / f"runs{args.world}" / f"{slug}_r{round_index}"
            runs[name].append(run(mesh, extra, folder, args.steps, args.world))
            print(name, {k: v for k, v in runs[name][-1].items() if k != "ranks"}, flush=True)
    total = job_ns_flops(_config("fsdp", [], args.out, args.steps, args.world))
    world = args.world
    table = BenchTable(
        f"hyperparallel train per mesh layout, {world} CPU ranks (median of {args.rounds} rounds "
        f"x steps 3-{args.steps})",
        [
            "layout",
            "mesh",
            "tokens/s",
            "vs first row",
            "forward+backward ms",
            "optimizer ms",
            "saved MiB / step",
            "peak live saved MiB",
            "NS GFLOP / rank (max)",
            "NS / job total",
            "max / even share",
            "first loss",
        ],
        metadata={"steps": args.steps, "rounds": args.rounds, "ns_gflop_job": total / 1e9},
    )
    reference = runs[cases[0][0]]
    for name, mesh, _ in cases:
        rounds = runs[name]
        ranks = [r for run_ in rounds for r in run_["ranks"]]
        first = rounds[0]["ranks"]
        flops = [r["ns_flops_per_step"] for r in first]
        table.add(
            layout=name,
            mesh=mesh,
            **{
                "tokens/s": statistics.median(r["tokens/s"] for r in rounds),
                "vs first row": statistics.median(
                    r["tokens/s"] / base["tokens/s"]
                    for r, base in zip(rounds, reference, strict=True)
                ),
                "forward+backward ms": statistics.median(r["forward+backward ms"] for r in rounds),
                "optimizer ms": statistics.median(r["optimizer ms"] for r in rounds),
                "saved MiB / step": max(r["saved_device_bytes"] for r in ranks) / 2**20,
                "peak live saved MiB": max(r["peak_live_saved_bytes"] for r in ranks) / 2**20,
                "NS GFLOP / rank (max)": max(flops) / 1e9,
                "NS / job total": sum(flops) / total,
                "max / even share": max(flops) / (total / world),
                "first loss": first[0]["first_loss"],
            },
        )
    _, md_path = table.write(args.out, "layouts" if world == 4 else "layouts_8")
    print(md_path.read_text())


if __name__ == "__main__":
    main()
