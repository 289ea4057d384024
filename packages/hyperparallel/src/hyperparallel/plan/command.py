"""What ``hyperparallel plan`` and ``modelzoo plan`` do once the configuration is read: refuse a
layout as the train job refuses it, then plan it (or search the meshes) and print the tables."""

from __future__ import annotations

from rich.console import Console

from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.plan.planner import make_plan
from hyperparallel.plan.profiles import load_profile
from hyperparallel.plan.report import print_plan
from hyperparallel.plan.search import parse_bytes, print_search, search_meshes
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.registry import model_spec


def run_plan(
    cfg: TrainConfig,
    world: int,
    *,
    device: str,
    search: bool = False,
    device_memory: str | None = None,
    efficiency: float | None = None,
    console: Console | None = None,
) -> None:
    """Plan ``cfg`` (its ``parallel.mesh``) on ``world`` ranks, or with ``search`` every mesh
    that fits ``device_memory`` (default: the device's), ranked by the step estimate.

    Raises:
        ValueError, FileNotFoundError: a refused mesh, model, device or size, in the job's
            one-line words, before any planning.
    """
    console = console or Console()
    if not console.is_terminal:  # a file or a pipe: wide enough for the tables
        console = Console(file=console.file, width=max(console.width, 150))
    if world < 1:
        raise ValueError(f"--world {world}: give a positive number of ranks")
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ValueError(f"--efficiency {efficiency}: give a fraction of the peak in (0, 1]")
    limit = parse_bytes(device_memory) if device_memory is not None else None
    if search:
        spec = model_spec(cfg)  # the model is checked before any mesh is tried
        profile = load_profile(device)
        found = search_meshes(cfg, spec, world, profile, limit, efficiency)
        print_search(found, world, limit or profile.memory_bytes.value, console)
        return
    dims = parse_mesh(cfg.parallel.mesh, world)
    model_spec(cfg).check_layout(dims)
    plan = make_plan(cfg, dims, load_profile(device), efficiency)
    print_plan(plan, console)
    if limit is not None and plan.worst.peak > limit:
        console.print(f"rank {plan.worst.rank} peaks above --device-memory {device_memory}")
