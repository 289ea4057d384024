"""``--search``: the meshes of a world size that fit a device's memory, ranked by the estimate.

Candidates are every ``pp x dp_replicate x ep x dp_shard`` factorisation of the world with pp
at most the blocks and ep dividing the experts (1 for a dense model); each is refused or planned
as ``hyperparallel plan`` would, sharing one meta-device model and one block measurement per
micro-batch size between them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from hyperparallel.parallel.mesh import ParallelDims
from hyperparallel.plan.planner import Plan, make_plan
from hyperparallel.plan.profiles import DeviceProfile
from hyperparallel.plan.report import seconds, size
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.hf_model import TransformersSpec, expert_count
from hyperparallel.train.model_spec import ModelSpec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"8e10"`` -> bytes.

    Raises:
        ValueError: naming the text and the units understood.
    """
    match = _SIZE.match(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"--device-memory {text!r}: give a size such as 80GiB or 80GB (units: B, KB, MB, "
            "GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(world: int, n_layers: int, n_experts: int) -> list[ParallelDims]:
    """Every factorisation of ``world`` with ``pp <= n_layers`` and ``ep`` dividing the experts."""
    found = []
    for pp in _divisors(world):
        if pp > n_layers:
            continue
        for ep in _divisors(world // pp):
            if ep > 1 and (not n_experts or n_experts % ep):
                continue
            rest = world // pp // ep
            for replicate in _divisors(rest):
                found.append(ParallelDims(pp, replicate, ep, rest // replicate))
    return found


@dataclass(frozen=True)
class SearchResult:
    """The planned meshes that fit (fastest first) and how many were refused or too large."""

    fitting: list[Plan]
    too_large: int
    refused: int


def search_meshes(
    cfg: TrainConfig,
    spec: ModelSpec,
    world: int,
    profile: DeviceProfile,
    limit: int | None = None,
    efficiency: float | None = None,
) -> SearchResult:
    """Plan every candidate mesh of ``world``; keep those whose worst rank peaks at most
    ``limit`` bytes (default: the device's memory), fastest estimate first."""
    limit = int(limit if limit is not None else profile.memory_bytes.value)
    with torch.device("meta"):
        module = spec.build_module(torch.device("meta"))
    experts = _expert_count(spec)
    measured: dict = {}
    fitting, too_large, refused = [], 0, 0
    for dims in candidate_meshes(world, spec.n_layers, experts):
        layout = cfg.model_copy(
            update={"parallel": cfg.parallel.model_copy(update={"mesh": dims.spec()})}
        )
        try:
            plan = make_plan(layout, dims, profile, efficiency, module=module, measured=measured)
        except ValueError:  # the job refuses this layout (batch, experts, stages)
            refused += 1
            continue
        if plan.worst.peak > limit:
            too_large += 1
            continue
        fitting.append(plan)
    fitting.sort(key=lambda p: (p.step_seconds or 0.0, p.worst.peak))
    return SearchResult(fitting, too_large, refused)


def _expert_count(spec: ModelSpec) -> int:
    if isinstance(spec, TransformersSpec):
        count = expert_count(spec.model.config)
        return count[1] if count else 0
    return spec.cfg.model.n_experts


def print_search(
    found: SearchResult, world: int, limit: float, console: Console, top: int = 15
) -> None:
    """The fastest fitting meshes, then how many others were refused or did not fit."""
    table = Table(title=f"Meshes of {world} ranks that fit {size(limit)} per rank, fastest first")
    for column in ("mesh", "peak (worst rank)", "step estimate", "NS max / mean"):
        table.add_column(column, justify="right")
    for plan in found.fitting[:top]:
        table.add_row(
            plan.inventory.dims.spec(),
            size(plan.worst.peak),
            seconds(plan.step_seconds or 0.0),
            f"{plan.ns['hyperparallel'].balance:.3f}",
        )
    console.print(table)
    console.print(
        f"{len(found.fitting)} fit, {found.too_large} do not fit, {found.refused} refused by the "
        "job's layout checks"
    )
