"""Device profiles for the step-time estimate: published figures of a few accelerators, and the
local CPU measured.

Each accelerator is a TOML file in ``plan/devices/`` whose every value names its source
(``published: <document>``, or ``assumed: <why>`` where no figure is published). The CPU profile
is measured here with npu-core's timer: an fp32 GEMM for FLOP/s and a large copy for memory
bandwidth; its "links" are memory copies, as gloo's ranks on one machine are.
"""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path

import torch
from pydantic import Field

from hyperparallel._config import StrictModel
from npu_core.bench import measure
from npu_core.machine import cpu_info


class Figure(StrictModel):
    """One number and where it comes from."""

    value: float = Field(gt=0, description="The figure, in base units (FLOP/s, bytes, bytes/s).")
    source: str = Field(
        description="'published: <document>', 'measured: <how>' or 'assumed: <why>'."
    )


class DeviceProfile(StrictModel):
    """What the estimate needs to know about one accelerator (per device, not per node)."""

    name: str = Field(description="The device, for reports.")
    ranks_per_node: int = Field(ge=1, description="Devices sharing the intra-node links.")
    bf16_flops: Figure = Field(description="Peak dense bf16 FLOP/s.")
    fp32_flops: Figure = Field(description="Peak dense fp32 FLOP/s.")
    memory_bytes: Figure = Field(description="Device memory, bytes.")
    memory_bandwidth: Figure = Field(description="Device memory bandwidth, bytes/s.")
    intra_node_bandwidth: Figure = Field(
        description="Link bandwidth to a device of the same node, bytes/s each way."
    )
    inter_node_bandwidth: Figure = Field(
        description="Network bandwidth to another node, bytes/s each way."
    )

    def flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for parameters of ``dtype`` (bf16 and fp16 share the tensor-core peak)."""
        return (self.fp32_flops if dtype == torch.float32 else self.bf16_flops).value


def profile_names() -> list[str]:
    """Names of the accelerator profiles shipped with hyperparallel, and ``cpu``."""
    folder = resources.files("hyperparallel.plan") / "devices"
    names = sorted(
        p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml")
    )
    return [*names, "cpu"]


def load_profile(name: str) -> DeviceProfile:
    """A shipped profile by name, ``cpu`` (measured now), or a TOML file of the same fields.

    Raises:
        ValueError: an unknown name (listing the known ones) or a file that is not a profile.
    """
    if name == "cpu":
        return measure_cpu()
    path = Path(name)
    if path.suffix == ".toml" and path.is_file():
        text = path.read_text()
    elif name in profile_names():
        text = (resources.files("hyperparallel.plan") / "devices" / f"{name}.toml").read_text()
    else:
        raise ValueError(
            f"--device {name}: unknown; choose one of {', '.join(profile_names())} or a .toml file"
        )
    return DeviceProfile.model_validate(tomllib.loads(text))


def measure_cpu(size: int = 1024, copy_bytes: int = 64 * 2**20) -> DeviceProfile:
    """This machine's CPU: fp32 GEMM FLOP/s and copy bandwidth (median of npu-core timings;
    bf16 is measured too, as slow CPUs emulate it)."""
    info = cpu_info()
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, dtype=dtype)

        def gemm(a: torch.Tensor = a) -> torch.Tensor:
            return a @ a

        rates[dtype] = 2 * size**3 / measure(gemm, warmup=1, repeats=5).median
    src = torch.empty(copy_bytes // 4)
    dst = torch.empty_like(src)
    copy = measure(lambda: dst.copy_(src), warmup=1, repeats=5)
    bandwidth = 2 * copy_bytes / copy.median  # read and write
    how = f"measured: npu-core timer on this CPU ({info.summary()})"
    return DeviceProfile(
        name=f"CPU ({info.model})",
        ranks_per_node=1 << 20,  # every rank on this machine: one "node"
        bf16_flops=Figure(value=rates[torch.bfloat16], source=f"{how}, {size}^3 bf16 GEMM"),
        fp32_flops=Figure(value=rates[torch.float32], source=f"{how}, {size}^3 fp32 GEMM"),
        memory_bytes=Figure(value=_physical_memory(), source="measured: os.sysconf physical pages"),
        memory_bandwidth=Figure(value=bandwidth, source=f"{how}, {copy_bytes >> 20} MiB copy"),
        intra_node_bandwidth=Figure(
            value=bandwidth, source=f"{how}, ranks exchange through memory"
        ),
        inter_node_bandwidth=Figure(value=bandwidth, source=f"{how}, one machine"),
    )


def _physical_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
