"""GELU (erf, tanh), SwiGLU and RoPE passes: matches, refusals, numerics in fp32 and bf16."""

from __future__ import annotations

import math

import pytest
import torch

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def gelu_erf(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def swiglu(x, w1, w3):
    a, b = x @ w1, x @ w3
    return a * torch.sigmoid(a) * b


def swiglu_exp(a, b):
    return a / (1 + torch.exp(-a)) * b


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def _randn(dtype, *shapes):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("fn", "approximate"), [(gelu_tanh, "tanh"), (gelu_erf, "none")], ids=["tanh", "erf"]
)
def test_gelu_rewrites_to_cheaper_exact_form(harness, fn, approximate, dtype):
    """Both GELU forms are recognised; tanh loses pow and tanh, erf loses the division."""
    (x,) = _randn(dtype, (8, 64))
    gm = harness.trace(fn, x)
    record = harness.apply(gm, "gelu")
    assert record.rewritten("gelu") == 1
    assert (
        harness.count(gm, aten.pow.Tensor_Scalar) == 0 and harness.count(gm, aten.div.Tensor) == 0
    )
    if approximate == "tanh":
        assert (
            harness.count(gm, aten.tanh.default) == 0
            and harness.count(gm, aten.sigmoid.default) == 1
        )
    torch.testing.assert_close(gm(x), fn(x), **harness.tolerance(dtype))
    reference = torch.nn.functional.gelu(x.float(), approximate=approximate).to(dtype)
    torch.testing.assert_close(gm(x), reference, **harness.tolerance(dtype))


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (lambda x: 0.7 * x * (1 + torch.erf(x / math.sqrt(2.0))), "0.5"),
        (lambda x: 0.5 * x * (1 + torch.erf(x / 2.0)), "1/sqrt(2)"),
        (lambda x: 0.5 * x * (1 + torch.tanh(0.8 * (x + 0.044715 * torch.pow(x, 3)))), "tanh"),
        (lambda x: 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.1 * torch.pow(x, 3)))), "tanh"),
        (lambda x: 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x**2))), "not 3"),
    ],
    ids=["scale", "erf-arg", "tanh-scale", "tanh-coeff", "square"],
)
def test_gelu_refuses_wrong_constants(harness, fn, reason):
    (x,) = _randn(torch.float32, (4, 16))
    gm = harness.trace(fn, x)
    record = harness.apply(gm, "gelu")
    assert record.rewritten() == 0
    assert any(reason in d.reason for d in record.refused("gelu")), record.summary()
    torch.testing.assert_close(gm(x), fn(x))


def test_gelu_leaves_decomposed_exact_gelu_alone(harness):
    """``F.gelu`` as Inductor decomposes it (erf of ``x * (1/sqrt 2)``, the GELU of BERT/ViT in
    transformers) already has the cheapest form: refused, graph and output unchanged."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    (x,) = _randn(torch.float32, (8, 64))

    def fn(t):
        return torch.nn.functional.gelu(t)

    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(x)
    assert harness.count(gm, aten.erf.default) == 1, "decomposition changed: test is stale"
    before = [str(n.target) for n in gm.graph.nodes]
    record = harness.apply(gm, "gelu")
    assert record.rewritten() == 0
    assert any("nothing to save" in d.reason for d in record.refused("gelu")), record.summary()
    assert [str(n.target) for n in gm.graph.nodes] == before
    torch.testing.assert_close(gm(x), torch.nn.functional.gelu(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_rewrites_sigmoid_form(harness, dtype):
    args = _randn(dtype, (6, 32), (32, 48), (32, 48))
    gm = harness.trace(swiglu, *args)
    record = harness.apply(gm, "swiglu")
    assert record.rewritten("swiglu") == 1
    assert "gate from mm, up from mm" in record.decisions[0].reason
    torch.testing.assert_close(gm(*args), swiglu(*args), **harness.tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_rewrites_exp_form(harness, dtype):
    """``a / (1 + exp(-a)) * b`` loses exp, neg and the division."""
    args = _randn(dtype, (6, 32), (6, 32))
    gm = harness.trace(swiglu_exp, *args)
    record = harness.apply(gm, "swiglu")
    assert record.rewritten("swiglu") == 1
    assert harness.count(gm, aten.exp.default) == 0 and harness.count(gm, aten.div.Tensor) == 0
    torch.testing.assert_close(gm(*args), swiglu_exp(*args), **harness.tolerance(dtype))


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: a / (1.0 + torch.exp(-a)) * b,
        lambda a, b: a / (torch.exp(-a) + 1.0) * b,
    ],
    ids=["1.0 + exp", "exp + 1.0"],
)
def test_swiglu_exp_form_with_a_float_one(harness, fn):
    """The one traced as 1.0 (either side of the add) is the same silu (it was missed)."""
    args = _randn(torch.float32, (6, 32), (6, 32))
    gm = harness.trace(fn, *args)
    record = harness.apply(gm, "swiglu")
    assert record.rewritten("swiglu") == 1
    assert harness.count(gm, aten.exp.default) == 0 and harness.count(gm, aten.div.Tensor) == 0
    torch.testing.assert_close(gm(*args), fn(*args))


def test_swiglu_refuses_broadcast_up(harness):
    a, b = _randn(torch.float32, (6, 32), (32,))
    gm = harness.trace(lambda a, b: a * torch.sigmoid(a) * b, a, b)
    record = harness.apply(gm, "swiglu")
    assert "broadcast" in record.refused("swiglu")[0].reason


def _rope_inputs(dtype):
    x, angles = _randn(torch.float32, (2, 4, 8, 16), (8, 8))
    angles = torch.cat([angles, angles], -1)
    return x.to(dtype), angles.cos().to(dtype), angles.sin().to(dtype)


def test_rope_rewrites_in_fp32(harness):
    args = _rope_inputs(torch.float32)
    gm = harness.trace(rope, *args)
    record = harness.apply(gm, "rope")
    assert record.rewritten("rope") == 1
    assert harness.count(gm, aten.neg.default) == 0
    torch.testing.assert_close(gm(*args), rope(*args))


def test_rope_skipped_in_bf16_unless_allowed(harness):
    """bf16 RoPE is refused by default; rope_low_precision=True opts in (within bf16 noise)."""
    args = _rope_inputs(torch.bfloat16)
    gm = harness.trace(rope, *args)
    record = harness.apply(gm, "rope")
    assert record.rewritten() == 0 and "drift" in record.refused("rope")[0].reason
    gm = harness.trace(rope, *args)
    record = harness.apply(gm, "rope", rope_low_precision=True)
    assert record.rewritten("rope") == 1
    torch.testing.assert_close(gm(*args), rope(*args), **harness.tolerance(torch.bfloat16))


def test_rope_refuses_mismatched_table(harness):
    x, cos, sin = _rope_inputs(torch.float32)
    fn = lambda x, c, s: x * c + rotate_half(x) * s  # noqa: E731
    gm = harness.trace(fn, x, cos[..., :1], sin[..., :1])
    record = harness.apply(gm, "rope")
    assert "cannot split" in record.refused("rope")[0].reason
