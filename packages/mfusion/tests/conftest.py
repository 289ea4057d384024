"""Shared fixtures: a per-session Inductor cache, a fresh report per test, and the pass-test
harness (tracing to post-grad-like graphs, running single passes, pinned machine profiles).

Helpers reach tests as fixtures, never through ``from conftest import``: the whole tree runs in
one pytest process with ``--import-mode=importlib``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

# One fresh Inductor cache per test session: runs never read another run's artefacts, and the
# second compile of a test still exercises the FX cache lookup (with mfusion's uuid in the key).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mfusion-inductor-"))
# The same for mlir-cpu's measured-choice cache: no test reads or writes the user's cache.
os.environ.setdefault("MFUSION_CACHE_DIR", tempfile.mkdtemp(prefix="mfusion-cache-"))


class FixedTimer:
    """The timer of a measured choice (mlir-cpu regions, whole graphs, GEMM libraries) with fixed
    answers: runs both calls once (they must work; with ``agree``, return the same values) and
    reports the given per-call times, the first for the candidate form (asked first), the second
    for Inductor's, so no decision depends on the speed of the test machine."""

    def __init__(self, first_s: float, second_s: float, agree: bool = False) -> None:
        self.times = (first_s, second_s)
        self.agree = agree
        self.calls = 0

    def __call__(self, calls: Any) -> dict[str, float]:
        self.calls += 1
        results = [call() for call in calls.values()]
        if self.agree:
            torch.testing.assert_close(*results, rtol=1e-4, atol=1e-4)
        return dict(zip(calls, self.times, strict=True))


def failing_timer(calls: Any) -> dict[str, float]:
    """A timer for where a cached decision must be used: any measurement fails the test."""
    raise AssertionError("the cached decision should have been used")


@pytest.fixture(autouse=True)
def _nothing_remembered():
    """Each test reads measured decisions from disk, not from an earlier test's memory."""
    from npu_core import decisions

    decisions.forget()
    yield
    decisions.forget()


class PassHarness:
    """Trace functions to aten graphs and run single passes on them, like Inductor's post-grad
    stage would; plus fixed machine profiles so machine-dependent outcomes never depend on the CPU,
    ISA cap or thread count the tests run on."""

    def __init__(self) -> None:
        from mfusion.machine import MachineProfile

        self.AVX512_BF16 = MachineProfile(
            arch="x86_64",
            cpu_model="test AVX-512 BF16",
            cpu_capability="AVX512",
            avx512_bf16=True,
            fast_bf16_gemm=True,
        )
        self.AVX2 = MachineProfile(arch="x86_64", cpu_model="test AVX2", cpu_capability="AVX2")

    fixed_timer = FixedTimer
    failing_timer = staticmethod(failing_timer)

    def machine(self, name: str, overrides: dict[str, Any] | None = None) -> Any:
        """The named fixed profile (``"AVX512_BF16"``, ``"AVX2"``) with fields replaced."""
        return dataclasses.replace(getattr(self, name), **(overrides or {}))

    @staticmethod
    def trace(fn: Any, *args: Any, mode: str = "fake") -> torch.fx.GraphModule:
        """The aten graph of ``fn`` with fake-tensor metadata, like Inductor's post-grad graph."""
        return make_fx(fn, tracing_mode=mode)(*args)

    @staticmethod
    def trace_dynamic(fn: Any, *args: torch.Tensor, dynamic: Any) -> torch.fx.GraphModule:
        """The aten graph of ``fn`` with the dims listed per argument in ``dynamic`` symbolic and
        every other dim static (Dynamo's ``dynamic=True`` on batch and sequence with a fixed
        hidden size, or on tokens with static weights), fake-tensor metadata with hints at the
        example sizes."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import (
            DimDynamic,
            ShapeEnv,
            StatelessSymbolicContext,
        )

        mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = []
        for arg, dims in zip(args, dynamic, strict=True):
            sizes = [
                DimDynamic.DYNAMIC if i in dims else DimDynamic.STATIC for i in range(arg.dim())
            ]
            context = StatelessSymbolicContext(sizes)
            fakes.append(mode.from_tensor(arg, symbolic_context=context))
        with mode:
            return make_fx(fn, tracing_mode="fake")(*fakes)

    @staticmethod
    def trace_on(device: str, fn: Any, *args: torch.Tensor, decompose: bool = True) -> Any:
        """The aten graph of ``fn`` with its tensor arguments moved to ``device`` as fake tensors
        (``"cuda"`` traces without a GPU: no kernel runs), with Inductor's decompositions, as
        Inductor's post-grad graph for that device would see them."""
        from torch._inductor.decomposition import select_decomp_table
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [mode.from_tensor(a).to(device) for a in args]
        table = select_decomp_table() if decompose else None
        return make_fx(fn, decomposition_table=table, tracing_mode="fake")(*fake)

    @staticmethod
    def apply(gm: torch.fx.GraphModule, *passes: str, **options: Any) -> Any:
        """Run the named passes (no auto-fusion) on ``gm`` in place and return the report."""
        from mfusion import MFusionConfig
        from mfusion.passes.manager import MFusionPassManager

        config = MFusionConfig(passes=passes, auto_fuse=False, **options)
        record = MFusionPassManager(config).run(gm.graph)
        gm.recompile()
        return record

    @staticmethod
    def step_equals_eager(
        model: nn.Module, reference: nn.Module, *inputs: torch.Tensor, **options: Any
    ) -> None:
        """One training step (scalar output, ``backward()``) of ``model`` compiled with mfusion's
        ``compile_options(**options)`` against ``reference``, an eager copy with the same
        weights: the loss and every parameter's gradient equal."""
        import mfusion

        compiled = torch.compile(model, options=mfusion.compile_options(**options))
        loss = compiled(*inputs)
        loss.backward()
        expected = reference(*inputs)
        expected.backward()
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)

    @staticmethod
    def count(gm: torch.fx.GraphModule, op: object) -> int:
        """How many call_function nodes of ``gm`` target ``op`` (counted independently of
        mfusion's own op counter)."""
        return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == op)

    @staticmethod
    def tolerance(dtype: torch.dtype) -> dict[str, float]:
        if dtype == torch.bfloat16:
            return {"atol": 2e-2, "rtol": 2e-2}
        return {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="session")
def harness() -> PassHarness:
    return PassHarness()


class TransformerBlock(nn.Module):
    """Hand-written RMSNorm -> SwiGLU MLP -> residual -> LayerNorm -> tanh-GELU, the spellings
    mfusion's ``rmsnorm``, ``swiglu``, ``layernorm`` and ``gelu`` passes recognise (as in the
    Llama, BERT and GPT-2 style models of its benchmark)."""

    EXPECTED = ("rmsnorm", "swiglu", "layernorm", "gelu")
    """The passes that rewrite this block on any device."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.ln_weight = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.ln_bias = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        a, b = self.gate(h), self.up(h)
        x = x + self.down(a * torch.sigmoid(a) * b)
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        y = (x - m) / torch.sqrt(v + 1e-5) * self.ln_weight + self.ln_bias
        c = math.sqrt(2 / math.pi)
        return 0.5 * y * (1 + torch.tanh(c * (y + 0.044715 * torch.pow(y, 3))))


@pytest.fixture(scope="session")
def transformer_block() -> type[TransformerBlock]:
    """The block class (tests build it at their own size, device and dtype)."""
    return TransformerBlock


@pytest.fixture(autouse=True)
def _fresh_report():
    import mfusion

    mfusion.clear_report()
    yield
    while mfusion.is_installed():
        mfusion.uninstall()
