"""The tiled and vectorised MLIR pipeline: outputs equal eager per region class, it really
vectorises, its exp/tanh expansions match torch's over the whole float range."""

from __future__ import annotations

import math

import pytest
import torch

from mfusion.mlir.importer import import_region
from mfusion.mlir.pipeline import lower_to_llvm
from mfusion.mlir.runtime import CompiledRegion
from mfusion.mlir.vectorize import tile_sizes


def rmsnorm(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def softmax(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def gelu_tanh(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x * 0.7071067811865476))


def layernorm(x, w, b):
    d = x - x.mean(-1, keepdim=True)
    return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w + b


def column_sum_sigmoid(x):
    return torch.sigmoid(x).sum(0), torch.exp(x) * 2.0


CASES = {
    # rows of 1024: tiled by 64 (reduction rows accumulate per tile)
    "rmsnorm": (rmsnorm, (torch.randn(32, 1024), torch.randn(1024))),
    "softmax": (softmax, (torch.randn(2, 4, 8, 192) * 4,)),
    "gelu_tanh": (gelu_tanh, (torch.randn(16, 1024) * 3, torch.randn(1024))),
    "gelu_erf": (gelu_erf, (torch.randn(4, 3072) * 3,)),
    "layernorm": (layernorm, (torch.randn(8, 48), torch.randn(48), torch.randn(48))),
    # reduction over the outer dim (tile 1 of a reduction loop), short rows
    "column_sum": (column_sum_sigmoid, (torch.randn(24, 40),)),
    # a row of 1000 has no 16-multiple divisor <= 64: its element-wise ops stay scalar loops
    "untiled_row": (softmax, (torch.randn(4, 1000),)),
}


def _run(region: CompiledRegion, fn, args):
    expected = fn(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    outputs = [torch.empty_like(e) for e in expected]
    region(list(args), outputs)
    return outputs, expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_vector_pipeline_matches_eager(harness, name):
    fn, args = CASES[name]
    ir = import_region(harness.trace(fn, *args))
    outputs, expected = _run(CompiledRegion(ir, "vector"), fn, args)
    for got, ref in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_vector_pipeline_emits_vector_code_and_scalar_does_not(harness):
    fn, args = CASES["rmsnorm"]
    ir = import_region(harness.trace(fn, *args))
    assert "vector<64xf32>" in str(lower_to_llvm(ir, "vector"))
    assert "vector<" not in str(lower_to_llvm(ir, "scalar"))


def test_unknown_pipeline_is_refused_by_name(harness):
    ir = import_region(harness.trace(softmax, torch.randn(2, 8)))
    with pytest.raises(ValueError, match=r"pipeline='fast' is not known; use one of"):
        lower_to_llvm(ir, "fast")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ranges", "reduction", "expected"),
    [
        ([256, 1024], False, [1, 64]),
        ([8, 32], False, [1, 0]),
        ([8, 128], False, [1, 0]),  # short rows stay whole
        ([256, 1, 1024], False, [1, 1, 64]),
        ([4, 192], False, [1, 64]),
        ([4, 208], False, [1, 16]),  # 208 = 13 x 16: the largest 16-multiple divisor <= 64
        ([4, 1000], False, None),  # no 16-multiple divisor <= 64: scalar loops
        ([256, 512], True, [1, 0]),  # reductions keep rows whole up to 512
        ([256, 768], True, [1, 384]),
        ([256, 1024], True, [1, 512]),
        ([None, 8], False, [1, 0]),  # a dynamic outer loop: rows of a static 8
        ([None, None, 1024], True, [1, 1, 512]),
        ([8, None], False, None),  # a dynamic innermost range is not vectorised
        ([], False, None),
    ],
)
def test_tile_sizes(ranges, reduction, expected):
    assert tile_sizes(ranges, reduction) == expected


SPECIAL = [0.0, -0.0, 1e-30, -1e-8, 1e-4, 0.0624, 0.0626, 0.5, -3.0, 9.0, 20.0, 88.0, 88.7]
SPECIAL += [88.73, 89.0, 1e4, -87.0, -88.0, -100.0, -103.9, -104.0, -1e4, math.inf, -math.inf]


@pytest.mark.parametrize("op", ["exp", "tanh", "erf"])
def test_expanded_transcendentals_match_torch(harness, op):
    """exp, tanh and erf are rewritten into arithmetic: compare with torch over [-120, 120],
    the overflow/underflow edges, infinities and NaN (an independent libm/Sleef reference)."""
    fn = {"exp": torch.exp, "tanh": torch.tanh, "erf": torch.erf}[op]
    x = torch.cat([torch.linspace(-120, 120, 48_000), torch.tensor(SPECIAL), torch.randn(960)])
    x = torch.cat([x, torch.full((64 - x.numel() % 64,), math.nan)]).reshape(-1, 64)
    ir = import_region(harness.trace(lambda t: fn(t) * 1.0, x))
    outputs, expected = _run(CompiledRegion(ir, "vector"), lambda t: fn(t) * 1.0, (x,))
    got, ref = outputs[0], expected[0]
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    finite = torch.isfinite(ref)
    assert torch.equal(got[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)])
    # within 4 ulp relative, or 1e-37 absolute where exp underflows to subnormals
    torch.testing.assert_close(got[finite], ref[finite], rtol=5e-7, atol=1e-37)
    if op != "exp":  # tiny x keeps its value (no cancellation near 0)
        torch.testing.assert_close(got[x == 1e-30], ref[x == 1e-30], rtol=5e-7, atol=0)
