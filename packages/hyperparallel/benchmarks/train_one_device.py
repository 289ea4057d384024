"""``hyperparallel train`` on one rank of the detected device, with and without swap to host.

Runs the CLI itself (its own launcher, one rank, the collective backend it picks: NCCL on CUDA,
gloo on the CPU) twice on the built-in MoE for ``--steps`` steps: once with no activation policy
and once with ``--activation swap --swap-inputs`` (every saved tensor of at least 64 KiB and
each block's inputs copied to pinned host memory on a side stream, brought back for backward).
Swapping moves bytes, not arithmetic, so both runs must report the same losses; the table shows
the gap, the speed of each run (rank 0's ``metrics.json``: median over steps 3..N) and the
saved-activation bytes by placement.

    python packages/hyperparallel/benchmarks/train_one_device.py --out DIR [--steps 20] [--small]

``--small`` trains the ``debug`` preset (seconds on a CPU); set ``NPU_CORE_BACKEND=cpu`` to
stay on the CPU on a machine with an accelerator. Writes ``DIR/<run>/`` (metrics.json,
loss.png, checkpoints, the CLI's output) and ``DIR/summary.json``; exits 1 when a run fails or
the losses differ by more than ``--loss-tol``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUNS = {
    "none": [],
    "swap": ["--activation", "swap", "--swap-inputs"],
}


def _train(out: Path, name: str, extra: list[str], steps: int, small: bool) -> dict[str, Any]:
    """One CLI run; its metrics.json summarised, with the wall time of the whole command."""
    folder = out / name
    command = [
        sys.executable,
        "-m",
        "hyperparallel.cli",
        "train",
        "--nproc",
        "1",
        "--steps",
        str(steps),
        "--out-dir",
        str(folder),
        "--overwrite",
        *(["--preset", "debug"] if small else []),
        *extra,
    ]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - began
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cli_output.txt").write_text(
        " ".join(command) + f"\nexit {done.returncode}\n--- stdout\n{done.stdout}\n"
        f"--- stderr\n{done.stderr}"
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"run {name!r} exited with {done.returncode}:\n{tail}")
    metrics = json.loads((folder / "metrics.json").read_text())
    train = metrics["train"]
    timed = train[2:] or train  # steps 1-2: allocator, cuBLAS and capability warm-up
    return {
        "wall_s": round(wall, 1),
        "losses": [r["loss"] for r in train],
        "val_loss": metrics["val"][-1]["loss"] if metrics["val"] else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "backward_ms": statistics.median(r["backward_ms"] for r in timed),
        "optim_ms": statistics.median(r["optim_ms"] for r in timed),
        "saved_device_mb": train[-1]["saved_device_mb"],
        "saved_host_mb": train[-1]["saved_host_mb"],
        "stdout": done.stdout.strip().splitlines(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the runs.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="The debug preset (CPU check).")
    parser.add_argument(
        "--loss-tol", type=float, default=1e-4, help="Largest allowed per-step loss gap."
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for name, extra in RUNS.items():
        try:
            results[name] = _train(args.out, name, extra, args.steps, args.small)
        except RuntimeError as exc:  # report the other run anyway
            failures[name] = str(exc)
            print(f"FAILED {exc}")
    gap = (
        max(
            abs(a - b)
            for a, b in zip(results["none"]["losses"], results["swap"]["losses"], strict=True)
        )
        if len(results) == len(RUNS)
        else float("nan")
    )
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    summary = {
        "device": device,
        "torch": torch.__version__,
        "steps": args.steps,
        "largest_loss_gap_swap_vs_none": gap,
        "runs": results,
        "failures": failures,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"device {device}, torch {torch.__version__}, {args.steps} steps, 1 rank")
    print(
        "| run | step-1 loss | last loss | val | tokens/s | fwd+bwd ms | optim ms | "
        "saved device MiB | saved host MiB | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"
        print(
            f"| {name} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} | {val} | "
            f"{r['tokens_per_s']:,.0f} | {r['backward_ms']:.1f} | {r['optim_ms']:.1f} | "
            f"{r['saved_device_mb']:.2f} | {r['saved_host_mb']:.2f} | {r['wall_s']} |"
        )
    print(f"largest per-step loss gap, swap vs none: {gap:.2e} (allowed {args.loss_tol:g})")
    return 0 if not failures and gap <= args.loss_tol else 1


if __name__ == "__main__":
    sys.exit(main())
