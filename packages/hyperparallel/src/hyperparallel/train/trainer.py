"""One rank of ``hyperparallel train``: start-up, the model on its mesh, Muon + AdamW, the loop.

Start-up overlaps: the process group is created in the background by mccl while this rank builds
its corpus; the first collective (building the device mesh) waits for it.
"""

from __future__ import annotations

import datetime
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mccl
from hyperparallel import env
from hyperparallel.activation import ActivationTracker, SwapSchedule
from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.train import checkpoint
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.metrics import MetricsLog
from hyperparallel.train.optimizer import build_optimizer
from hyperparallel.train.parallel_model import ParallelModel
from hyperparallel.train.profiling import StepProfiler
from hyperparallel.train.registry import model_spec
from npu_core.device import comm_backend, detect_backend, device_for_rank, device_module
from npu_core.memory import memory_stats, reset_peak_memory_stats

StepCallback = Callable[[dict[str, float]], None]

WAIT_NOTICE_S = 3.0
"""How long rank 0 waits quietly for the other ranks at start-up before saying it waits."""


@dataclass(frozen=True)
class TrainResult:
    """What a finished rank reports back to the launcher."""

    rank: int
    first_step: int
    last_step: int
    train_losses: list[float]
    val_losses: list[float]
    skipped_muon_steps: int
    activation: dict[str, int]
    """Saved-activation bytes of this rank's last training step, by placement."""


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at the last step."""
    warmup = cfg.optim.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    floor = cfg.optim.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _mean_over_ranks(value: torch.Tensor | float | None, device: torch.device) -> float:
    """Mean of the values the reporting ranks hold (every rank, or under PP the ranks holding
    the last stage; the others pass None).

    The sum travels on ``device``, the rank's training device: an NCCL (or HCCL) process group
    has no CPU collectives.
    """
    t = torch.zeros(2, dtype=torch.float64, device=device)
    if value is not None:
        t[0], t[1] = float(value), 1.0
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def _every_rank(value: float, device: torch.device) -> list[float]:
    """``value`` of every rank, in rank order (gathered on ``device``, as in
    :func:`_mean_over_ranks`)."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def train_rank(cfg: TrainConfig, resume: bool, on_step: StepCallback | None = None) -> TrainResult:
    """Run training on this rank (under the npu-core launcher or torchrun) and return its losses.

    The default process group is created here (``parallel.timeout_s``) unless the caller made
    one already, so a caller can run several trainings in one set of ranks.
    """
    backend = detect_backend()
    timeout_s = cfg.parallel.timeout_s
    handle = None
    if not mccl.is_ready():
        handle = mccl.init_process_group(
            comm_backend(backend).value,
            timeout=datetime.timedelta(seconds=timeout_s),
            init_timeout=timeout_s,
        )
    device = device_for_rank(env.local_rank(), backend)
    module = device_module(backend)
    if module is not None:
        # NCCL / HCCL bind a rank's communicators (barrier, object collectives of DCP and of
        # --resume) to the current device; without this every local rank would use device 0.
        module.set_device(device)
    spec = model_spec(cfg)
    with warnings.catch_warnings():  # skipped binary files: the CLI reported them once
        warnings.simplefilter("ignore", RuntimeWarning)
        data = spec.batches()
    if handle is not None and env.is_rank_zero():
        _say_what_start_up_waits_for(handle, timeout_s)
    world = dist.get_world_size()  # waits for mccl here
    dims = parse_mesh(cfg.parallel.mesh, world)
    batch = spec.check_layout(dims)
    meshes = dims.build(device.type)
    net = spec.build(meshes, device)
    optimizer = build_optimizer(cfg, net)
    inner = tuple(opt for opt in (optimizer.muon, optimizer.adamw) if opt is not None)
    base_lrs = [group["lr"] for opt in inner for group in opt.param_groups]
    out = Path(cfg.out_dir)
    ckpt_root = out / "checkpoints"
    rank, dp_rank = dist.get_rank(), meshes.dp_rank
    profiler = StepProfiler(cfg.profile_steps, out, rank, device)
    start = 0
    if resume:
        start = _resume(ckpt_root, net.owner, inner, cfg.steps)
    log = MetricsLog.resume(out / "metrics.json", start) if rank == 0 else MetricsLog()
    train_losses, val_losses = [], []
    act = cfg.activation
    for step in range(start, cfg.steps):
        # The inner optimizers' own groups: loading a checkpoint replaces those dicts.
        groups = [group for opt in inner for group in opt.param_groups]
        for group, base in zip(groups, base_lrs, strict=True):
            group["lr"] = base * lr_factor(step, cfg)
        reset_peak_memory_stats(device)
        began = time.perf_counter()
        with profiler.step(step + 1):
            inputs, targets = data.train_batch(step, dp_rank, batch)
            schedule = SwapSchedule(act.offload_after, act.prefetch_ahead, act.early_recompute)
            with ActivationTracker() as tracker, schedule:
                loss = net.forward_backward(inputs.to(device), targets.to(device))
            saved = tracker.report()
            opt_began = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_done = time.perf_counter()  # before a profiled step writes its trace
            optim_ms = (step_done - opt_began) * 1e3
            peak_bytes = memory_stats(device).peak_allocated_bytes
        mean_loss = _mean_over_ranks(loss, device)
        train_losses.append(mean_loss)
        record: dict[str, Any] = {
            "step": step + 1,
            "loss": mean_loss,
            "lr_factor": lr_factor(step, cfg),
            "tokens_per_s": dims.dp_size * inputs.numel() / (step_done - began),
            "optim_ms": optim_ms,
            "backward_ms": (opt_began - began) * 1e3,
            "saved_device_mb": saved.device_bytes / 2**20,
            "saved_host_mb": saved.host_bytes / 2**20,
            "saved_recomputed_mb": saved.recomputed_bytes / 2**20,
            "peak_memory_mb": _every_rank(peak_bytes / 2**20, device),
        }
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record["val_loss"] = _validate(net, data, dp_rank, batch, cfg, device)
            val_losses.append(record["val_loss"])
            if rank == 0:
                log.val.append({"step": step + 1, "loss": record["val_loss"]})
        if rank == 0:
            log.train.append({k: v for k, v in record.items() if k != "val_loss"})
            if on_step is not None:
                on_step(record)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            checkpoint.save(
                ckpt_root, step + 1, net.owner, inner, keep=cfg.keep_checkpoints, warn=_warn
            )
            if rank == 0:
                log.write(out / "metrics.json", cfg.model_dump())
    if rank == 0:
        log.write(out / "metrics.json", cfg.model_dump())
        log.plot(out / "loss.png")
    return TrainResult(
        rank,
        start,
        cfg.steps,
        train_losses,
        val_losses,
        # no Muon optimizer when no parameter of this rank is routed to it
        sum(optimizer.muon.skipped_steps.values()) if optimizer.muon is not None else 0,
        saved.to_dict() if start < cfg.steps else {},
    )


def _say_what_start_up_waits_for(handle: mccl.InitHandle, timeout_s: float) -> None:
    """One line on stderr when the other ranks have not all arrived :data:`WAIT_NOTICE_S` after
    this one is ready (under torchrun, a rank that was never started), instead of silence until
    the timeout; a start-up failure is left to the first use of the group, which raises it."""
    try:
        handle.wait(WAIT_NOTICE_S)
    except TimeoutError:
        waiting_for = handle.waiting_for()
        if waiting_for is not None:
            print(f"waiting for {waiting_for} (timeout {timeout_s:g} s)", file=sys.stderr)


def _warn(message: str) -> None:
    """A ``warning:`` line on stderr, as the CLI prints its own (here from rank 0, which
    removes old checkpoints after a save)."""
    print(f"warning: {message}", file=sys.stderr)


def _resume(root: Path, model: torch.nn.Module, optimizers: tuple, steps: int) -> int:
    """Load the newest intact checkpoint (chosen by rank 0, so every rank loads the same one).

    Damaged newer checkpoints are skipped quietly: the job named them before ranks started
    (:func:`hyperparallel.train.job.check`), as ``warning:`` lines of the CLI.
    """
    choice: list[Path | str | None] = [None]
    if dist.get_rank() == 0:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                choice[0] = checkpoint.latest(root)
        except checkpoint.CheckpointError as exc:
            choice[0] = str(exc)
    dist.broadcast_object_list(choice, src=0)
    found = choice[0]
    if isinstance(found, str):
        raise checkpoint.CheckpointError(found)
    if found is None:
        raise checkpoint.CheckpointError(f"--resume: no checkpoint under {root}")
    start = checkpoint.load(found, model, optimizers)
    if start >= steps:
        raise checkpoint.CheckpointError(
            f"--resume: {found.name} is at step {start}, and steps={steps} leaves nothing to "
            f"train; pass --steps above {start}"
        )
    return start


def _validate(
    net: ParallelModel,
    data: ByteBatches,
    dp_rank: int,
    batch: int,
    cfg: TrainConfig,
    device: torch.device,
) -> float:
    losses = []
    for inputs, targets in data.val_batches(dp_rank, batch, cfg.eval_batches):
        loss = net.evaluate(inputs.to(device), targets.to(device))
        if loss is not None:
            losses.append(loss)
    return _mean_over_ranks(torch.stack(losses).mean() if losses else None, device)
