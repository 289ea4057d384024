"""The ``rational`` pass: erf and tanh as rational functions, checked against float64 torch."""

from __future__ import annotations

import math

import pytest
import torch

import mfusion
from mfusion.passes.rational import RATIONALS

aten = torch.ops.aten
ACCURACY = 5e-7
"""Max abs error of the float32 forms against float64: no worse than Inductor's own float32 erf
kernel (5.3e-7; the fit script prints 3.8e-7 and 3.3e-7 for the rational forms, and the margin
leaves room for another ISA's rounding, e.g. without fused multiply-adds)."""
SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e-8, 3.99, 4.0, 4.01, 8.99, 9.0, 9.01, 50.0, -50.0, 1e30]
FUNCTIONS = {"erf": torch.erf, "tanh": torch.tanh}


def _grid() -> torch.Tensor:
    dense = torch.linspace(-12.0, 12.0, 200_001, dtype=torch.float64)
    return torch.cat([dense, torch.tensor(SPECIAL, dtype=torch.float64)])


def _assert_accurate(out: torch.Tensor, x: torch.Tensor, fn) -> None:
    reference = fn(x.double())
    error = (out.double() - reference).abs()
    worst = error.argmax()
    assert error[worst].item() <= ACCURACY, f"error {error[worst].item():.3g} at {x[worst]}"
    assert out.abs().max().item() <= 1.0, "left [-1, 1]"
    # Past the clamp the library functions round to exactly +-1; so must the rational form.
    saturated = x.abs() >= 9.0
    torch.testing.assert_close(out[saturated], torch.sign(x[saturated]), atol=0, rtol=0)
    # Odd, with the sign of zero kept.
    assert torch.equal(torch.signbit(out[x == 0]), torch.signbit(x[x == 0]))


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_rewrites_to_an_accurate_rational(harness, name):
    fn = FUNCTIONS[name]
    x = _grid().float()
    gm = harness.trace(fn, x)
    record = harness.apply(gm, "rational")
    assert record.rewritten("rational") == 1
    assert harness.count(gm, getattr(aten, name).default) == 0
    _assert_accurate(gm(x), x, fn)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_compiled_kernel_is_accurate_and_keeps_special_values(name):
    """What Inductor generates from the rewritten graph, not only the eager ops: the clamps must
    keep NaN and send +-inf to +-1 in the vectorised loop and in its scalar tail."""
    fn = FUNCTIONS[name]
    x = _grid().float()
    compiled = torch.compile(fn, options=mfusion.compile_options(passes=("rational",)))
    _assert_accurate(compiled(x), x, fn)
    assert mfusion.report().rewritten("rational") == 1
    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.5, -0.5, 2.0, -7.0])  # tail of 7
    out = compiled(specials)
    assert torch.isnan(out[0]) and out[1].item() == 1.0 and out[2].item() == -1.0
    torch.testing.assert_close(out[3:], fn(specials[3:]), atol=ACCURACY, rtol=0)


def test_reference_form_matches_the_pass(harness):
    """``Rational.reference`` (eager torch) and the emitted graph compute the same thing."""
    x = torch.linspace(-10, 10, 4001)
    for op, rational in RATIONALS.items():
        gm = harness.trace(op, x)
        harness.apply(gm, "rational")
        torch.testing.assert_close(gm(x), rational.reference(x), atol=0, rtol=0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_in_a_compiled_mlp_forward_and_backward(harness, approximate):
    """GELU's erf and tanh inside a compiled model: forward and gradients as eager's."""
    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(approximate=approximate), torch.nn.Linear(64, 8)
        )

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = build()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x).square().mean()

    x = torch.randn(16, 32)
    harness.step_equals_eager(Loss(), Loss(), x, passes=("rational",))
    assert mfusion.report().rewritten("rational") >= 1


@pytest.mark.parametrize(
    ("dtype", "reason"), [(torch.float64, "float64"), (torch.bfloat16, "bfloat16")]
)
def test_refuses_other_dtypes(harness, dtype, reason):
    x = torch.randn(8, 8).to(dtype)
    gm = harness.trace(torch.erf, x)
    record = harness.apply(gm, "rational")
    assert record.rewritten("rational") == 0
    assert harness.count(gm, aten.erf.default) == 1
    assert any(reason in d.reason for d in record.refused("rational"))


def test_refuses_gpu_graphs(harness):
    gm = harness.trace_on("cuda", torch.tanh, torch.randn(8, 8))
    record = harness.apply(gm, "rational")
    assert harness.count(gm, aten.tanh.default) == 1
    assert any("device cuda" in d.reason for d in record.refused("rational"))


def test_refuses_under_the_mlir_backend(harness):
    gm = harness.trace(torch.tanh, torch.randn(8, 8))
    record = harness.apply(gm, "rational", backend="mlir-cpu")
    assert harness.count(gm, aten.tanh.default) == 1
    assert any("mlir-cpu" in d.reason for d in record.refused("rational"))
