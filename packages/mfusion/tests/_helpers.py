"""Trace functions to post-grad-like aten graphs and run single passes on them."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mfusion import MFusionConfig
from mfusion.machine import MachineProfile
from mfusion.passes._graph import op_counts
from mfusion.passes.manager import MFusionPassManager
from mfusion.report import GraphReport


def trace(fn, *args, mode: str = "fake") -> torch.fx.GraphModule:
    """The aten graph of ``fn`` with fake-tensor metadata, like Inductor's post-grad graph."""
    return make_fx(fn, tracing_mode=mode)(*args)


def apply(gm: torch.fx.GraphModule, *passes: str, **options) -> GraphReport:
    """Run the named passes (no auto-fusion) on ``gm`` in place and recompile it."""
    config = MFusionConfig(passes=passes, auto_fuse=False, **options)
    record = MFusionPassManager(config).run(gm.graph)
    gm.recompile()
    return record


def count(gm: torch.fx.GraphModule, op: object) -> int:
    return op_counts(gm.graph).get(str(op), 0)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


# Fixed machine profiles: tests of machine-dependent rewrites pin the machine they decide for, so
# the outcome never depends on the CPU, ISA cap or thread count the tests run on.
AVX512_BF16 = MachineProfile(
    arch="x86_64",
    cpu_model="test AVX-512 BF16",
    cpu_capability="AVX512",
    avx512_bf16=True,
    fast_bf16_gemm=True,
)
AVX2 = MachineProfile(arch="x86_64", cpu_model="test AVX2", cpu_capability="AVX2")
