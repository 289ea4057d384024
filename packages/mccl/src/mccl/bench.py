"""Start-up benchmark: synchronous init versus mccl, with a simulated device initialisation.

Each rank waits at a common store barrier, then either initialises the process group and its
device one after the other (torch's blocking path) or overlaps the two (mccl), and finally runs a
first all_reduce. The time reported for a round is the slowest rank's barrier-to-all_reduce time:
the job cannot start before its last rank does.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field, field_validator

# torch.distributed re-exports these without declaring them (no `as`, not in __all__)
from torch._C._distributed_c10d import TCPStore

from mccl import env
from mccl.api import init_process_group as mccl_init_process_group
from npu_core.bench import BenchTable
from npu_core.config import StrictConfig
from npu_core.device import check_comm_backend
from npu_core.dist import LOOPBACK, find_free_port, launch
from npu_core.files import UnwritableFolderError, check_writable_folder

MODES = ("sync", "mccl")


class StartupBenchConfig(StrictConfig):
    """What to measure; every field is a ``mccl bench`` option (and ``--set`` key)."""

    ranks: tuple[int, ...] = Field(
        (2, 8, 32), description="World sizes to measure, each on loopback in its own launch."
    )
    rounds: int = Field(
        5, ge=1, description="Measured rounds per mode (sync and mccl alternate: same noise)."
    )
    calibration_rounds: int = Field(
        3, ge=1, description="Rounds of init alone, to size the simulated device init."
    )
    device_init: Literal["sleep", "compute"] = Field(
        "sleep", description="Simulated device init: sleep (idle wait) or compute (busy matmuls)."
    )
    device_init_ms: float | None = Field(
        None, ge=0, description="Device init duration in ms; default: the measured sync init time."
    )
    backend: str = Field("gloo", description="Collective backend under test.")

    @field_validator("ranks")
    @classmethod
    def _world_sizes(cls, ranks: tuple[int, ...]) -> tuple[int, ...]:
        if not ranks or min(ranks) < 2:
            raise ValueError("every world size must be >= 2")
        return ranks


def _launcher_int(name: str) -> int:
    """A variable ``npu_core.dist.launch`` sets for every rank of the benchmark."""
    value = env.integer(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: benchmark ranks run under npu_core's launcher")
    return value


def _simulate_device_init(kind: str, seconds: float) -> None:
    end = time.perf_counter() + seconds
    if kind == "sleep":
        time.sleep(seconds)
        return
    a = torch.randn(256, 256)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


class _Control:
    """A store shared by all ranks of one launch, for barriers and small agreements.

    It lives on the launcher's port; each round then gets a fresh port of its own.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.store = TCPStore(
            LOOPBACK,
            _launcher_int(env.MASTER_PORT),
            world_size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=300),
        )

    def barrier(self, key: str) -> None:
        if self.store.add(f"{key}/arrived", 1) == self.world_size:
            self.store.set(f"{key}/go", "1")
        self.store.wait([f"{key}/go"])

    def shared_port(self, key: str) -> int:
        if self.rank == 0:
            self.store.set(f"{key}/port", str(find_free_port()))
        return int(self.store.get(f"{key}/port"))

    def close(self) -> None:
        """Rank 0 hosts the store: it leaves only after every other rank is done reading it."""
        if self.rank != 0:
            self.store.add("closed", 1)
            return
        while self.store.add("closed", 0) < self.world_size - 1:
            time.sleep(0.005)

    def gather_floats(self, key: str, value: float) -> list[float]:
        self.store.set(f"{key}/{self.rank}", repr(value))
        return [float(self.store.get(f"{key}/{r}")) for r in range(self.world_size)]


def _one_round(
    ctl: _Control, key: str, mode: str, cfg: StartupBenchConfig, device_s: float
) -> tuple[float, float]:
    """(barrier to first all_reduce, initialisation alone) in seconds, on this rank."""
    rank, world = ctl.rank, ctl.world_size
    port = ctl.shared_port(key)
    # As under torchrun, the store server exists before the ranks start (the elastic agent hosts
    # it) and every rank joins it as a client through env://. Letting rank 0 create it inside the
    # timed region instead measures TCPStore's connect-retry back-off (seconds at 16+ ranks).
    server = (
        TCPStore(LOOPBACK, port, world, is_master=True, wait_for_workers=False)
        if (rank == 0)
        else None
    )
    env.set_rendezvous(LOOPBACK, port, agent_store=True)
    ctl.barrier(f"{key}/start")
    start = time.perf_counter()
    handle = None
    if mode == "mccl":
        handle = mccl_init_process_group(cfg.backend, rank=rank, world_size=world)
    else:
        dist.init_process_group(cfg.backend, rank=rank, world_size=world)
    returned_s = time.perf_counter() - start
    _simulate_device_init(cfg.device_init, device_s)
    dist.all_reduce(torch.ones(1))
    elapsed = time.perf_counter() - start
    # mccl's background initialisation reports its own time; where the blocking path ran
    # inside the call (sync mode, or MCCL_ASYNC_INIT=0 turning mccl's off) it is the call's
    background_s = handle.elapsed() if handle is not None else None
    init_s = returned_s if background_s is None else background_s
    ctl.barrier(f"{key}/end")  # nobody tears down a group (or its store) a peer still uses
    dist.destroy_process_group()
    del server
    return elapsed, init_s


def _rank_main(cfg: StartupBenchConfig) -> dict[str, list[float] | float]:
    """One rank: calibrate, then alternate sync and mccl rounds; values are max over ranks."""
    ctl = _Control(_launcher_int(env.RANK), _launcher_int(env.WORLD_SIZE))
    slowest: dict[str, list[float]] = {"init": [], "sync": [], "mccl": [], "mccl_init": []}

    def record(mode: str, key: str, device_s: float) -> None:
        total, init = _one_round(ctl, key, mode, cfg, device_s)
        slowest[mode].append(max(ctl.gather_floats(f"{key}/t", total)))
        if mode == "mccl":
            slowest["mccl_init"].append(max(ctl.gather_floats(f"{key}/i", init)))

    for mode in MODES:  # first connections and first calls pay one-off costs
        _one_round(ctl, f"warmup/{mode}", mode, cfg, 0.0)
    for i in range(cfg.calibration_rounds):
        record("init", f"calib{i}", 0.0)
    init_s = statistics.median(slowest["init"])
    device_s = init_s if cfg.device_init_ms is None else cfg.device_init_ms / 1000
    for i in range(cfg.rounds):
        for mode in MODES if i % 2 == 0 else reversed(MODES):
            record(mode, f"round{i}/{mode}", device_s)
    ctl.close()
    return {**slowest, "device_s": device_s}


@dataclass(frozen=True)
class StartupResult:
    """Medians over rounds of the slowest rank's time, in seconds."""

    ranks: int
    init_s: float
    """Stock blocking init alone (calibration rounds, no device init)."""
    mccl_init_s: float
    """mccl's background initialisation, as measured by its handle in the mccl rounds."""
    device_s: float
    sync_s: float
    mccl_s: float
    speedup: float
    """Median over rounds of sync / mccl (rounds are adjacent, so the ratio is robust)."""

    @property
    def overlap_ratio(self) -> float:
        """mccl time over max(mccl init, device init): 1.0 is perfect overlap."""
        return self.mccl_s / max(self.mccl_init_s, self.device_s)

    @property
    def meets_target(self) -> bool:
        """mccl <= max(its init, device) + 10%; >= 1.5x faster than sync when phases are alike."""
        comparable = 0.5 <= self.device_s / self.init_s <= 2.0
        return self.overlap_ratio <= 1.10 and (not comparable or self.speedup >= 1.5)


def preflight(cfg: StartupBenchConfig, out: Path) -> None:
    """Refuse, before any rank starts, what would fail inside every rank or at the end.

    Raises:
        ValueError: the backend cannot run here, or ``out`` cannot hold the results; the
            message names the option.
    """
    try:
        check_comm_backend(cfg.backend)
    except ValueError as exc:
        raise ValueError(f"--backend {cfg.backend}: {exc}") from None
    try:
        check_writable_folder(out)
    except UnwritableFolderError as exc:
        raise ValueError(f"--out {exc}") from None


def measure_startup(
    cfg: StartupBenchConfig, progress: Callable[[int], None] | None = None
) -> list[StartupResult]:
    """Launch each world size of ``cfg.ranks`` on loopback and measure it."""
    results = []
    for world in cfg.ranks:
        if progress is not None:
            progress(world)
        values = launch(_rank_main, world, cfg, backend=None, timeout=600)[0]
        ratios = [s / m for s, m in zip(values["sync"], values["mccl"], strict=True)]
        results.append(
            StartupResult(
                ranks=world,
                init_s=statistics.median(values["init"]),
                mccl_init_s=statistics.median(values["mccl_init"]),
                device_s=values["device_s"],
                sync_s=statistics.median(values["sync"]),
                mccl_s=statistics.median(values["mccl"]),
                speedup=statistics.median(ratios),
            )
        )
    return results


def results_table(cfg: StartupBenchConfig, results: list[StartupResult]) -> BenchTable:
    """The README table: one row per world size, times in milliseconds."""
    table = BenchTable(
        f"mccl start-up, {cfg.backend} on loopback, device init = {cfg.device_init}",
        [
            "ranks",
            "init alone (ms)",
            "mccl init (ms)",
            "device init (ms)",
            "sync (ms)",
            "mccl (ms)",
            "speedup",
            "mccl / max(mccl init, device)",
            "target met",
        ],
        metadata=cfg.model_dump(mode="json"),
    )
    for r in results:
        table.add(
            **{
                "ranks": r.ranks,
                "init alone (ms)": r.init_s * 1e3,
                "mccl init (ms)": r.mccl_init_s * 1e3,
                "device init (ms)": r.device_s * 1e3,
                "sync (ms)": r.sync_s * 1e3,
                "mccl (ms)": r.mccl_s * 1e3,
                "speedup": r.speedup,
                "mccl / max(mccl init, device)": r.overlap_ratio,
                "target met": "yes" if r.meets_target else "no",
            }
        )
    return table
