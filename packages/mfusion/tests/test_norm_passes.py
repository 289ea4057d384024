"""RMSNorm, Add+RMSNorm, LayerNorm and Mean+Var passes: matches, refusals, numerics."""

from __future__ import annotations

import pytest
import torch

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rmsnorm_div(x, w):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w


def add_rmsnorm(x, r, w):
    h = x + r
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return y.to(x.dtype) * w, h


def layernorm(x, w, b):
    m = x.mean(-1, keepdim=True)
    v = ((x - m) ** 2).mean(-1, keepdim=True)
    return (x - m) / torch.sqrt(v + 1e-5) * w + b


def layernorm_bert(x, w, b):
    """BERT_pytorch's spelling: the weight multiplies the centred input before the division."""
    m = x.mean(-1, keepdim=True)
    v = ((x - m) ** 2).mean(-1, keepdim=True)
    return w * (x - m) / torch.sqrt(v + 1e-5) + b


def layernorm_var(x, w, b):
    m = x.mean(-1, keepdim=True)
    v = x.var(-1, keepdim=True, correction=0)
    return (x - m) * torch.rsqrt(v + 1e-5) * w + b


def _inputs(dtype, *shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [rmsnorm, rmsnorm_div])
def test_rmsnorm_rewrites_and_matches_eager(harness, fn, dtype):
    """Both spellings become mul(x, x) -> mean -> rsqrt -> mul and agree with eager."""
    args = _inputs(dtype, (4, 8, 64), (64,))
    gm = harness.trace(fn, *args)
    record = harness.apply(gm, "rmsnorm")
    assert record.rewritten("rmsnorm") == 1
    assert harness.count(gm, aten.pow.Tensor_Scalar) == 0
    assert harness.count(gm, aten.div.Tensor) == 0 and harness.count(gm, aten.sqrt.default) == 0
    assert harness.count(gm, aten.rsqrt.default) == 1 and harness.count(gm, aten.mean.dim) == 1
    torch.testing.assert_close(gm(*args), fn(*args), **harness.tolerance(dtype))


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (lambda x: x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6), "exponent 3"),
        (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)), "eps missing"),
        (lambda x: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6), "last dim"),
        (lambda x: x * torch.rsqrt(x.pow(2).mean(-1) + 1e-6), "keepdim"),
        (lambda x: x * torch.rsqrt((x + 1).pow(2).mean(-1, keepdim=True) + 1e-6), "scales"),
    ],
    ids=["pow3", "no-eps", "wrong-dim", "no-keepdim", "other-tensor"],
)
def test_rmsnorm_refuses_near_misses(harness, fn, reason):
    """Near misses are reported with a reason and the graph is left unchanged."""
    (x,) = _inputs(torch.float32, (64, 64))
    gm = harness.trace(fn, x)
    record = harness.apply(gm, "rmsnorm")
    assert record.rewritten() == 0
    assert any(reason in d.reason for d in record.refused("rmsnorm")), record.summary()
    assert record.ops_before == record.ops_after
    torch.testing.assert_close(gm(x), fn(x), equal_nan=True)


def test_rmsnorm_integer_input_refused(harness):
    """A pattern over an integer tensor is refused by the dtype check."""
    gm = harness.trace(
        lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), torch.ones(2, 8)
    )
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = node.meta["val"].to(torch.int32)
    record = harness.apply(gm, "rmsnorm")
    assert "floating" in record.refused("rmsnorm")[0].reason


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_keeps_residual(harness, dtype):
    """The residual sum stays a graph output while the norm is rewritten."""
    args = _inputs(dtype, (2, 4, 32), (2, 4, 32), (32,))
    gm = harness.trace(add_rmsnorm, *args)
    record = harness.apply(gm, "add_rmsnorm", "rmsnorm")
    assert record.rewritten("add_rmsnorm") == 1 and record.rewritten("rmsnorm") == 0
    assert "sum kept" in record.decisions[0].reason
    out, residual = gm(*args)
    ref_out, ref_residual = add_rmsnorm(*args)
    torch.testing.assert_close(residual, ref_residual)
    torch.testing.assert_close(out, ref_out, **harness.tolerance(dtype))


def test_add_rmsnorm_refuses_broadcast_add(harness):
    """An add that broadcasts (bias, not residual) is refused by Add+RMSNorm."""
    x, b = _inputs(torch.float32, (4, 32), (32,))
    gm = harness.trace(lambda x, b: rmsnorm(x + b, 1.0), x, b)
    record = harness.apply(gm, "add_rmsnorm")
    assert "broadcasts" in record.refused("add_rmsnorm")[0].reason


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [layernorm, layernorm_bert, layernorm_var])
def test_layernorm_uses_one_var_mean(harness, fn, dtype):
    """Two reductions (mean, mean of squares) become one Welford var_mean."""
    args = _inputs(dtype, (3, 5, 48), (48,), (48,))
    gm = harness.trace(fn, *args)
    assert harness.count(gm, aten.mean.dim) + harness.count(gm, aten.var.correction) == 2
    record = harness.apply(gm, "layernorm")
    assert record.rewritten("layernorm") == 1
    assert harness.count(gm, aten.var_mean.correction) == 1
    assert harness.count(gm, aten.mean.dim) == 0 and harness.count(gm, aten.var.correction) == 0
    torch.testing.assert_close(gm(*args), fn(*args), **harness.tolerance(dtype))
    x, w, b = (a.float() for a in args)
    reference = torch.nn.functional.layer_norm(x, (48,), w, b)
    torch.testing.assert_close(gm(*args).float(), reference, **harness.tolerance(dtype))


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (
            lambda x: (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5),
            "correction=1",
        ),
        (
            lambda x: (
                (x - x.mean(-1, keepdim=True))
                / torch.sqrt(((x - x.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True))
            ),
            "eps missing",
        ),
        (
            lambda x: (
                (x - x.mean(-1, keepdim=True))
                / torch.sqrt(((x - x.mean(-1, keepdim=True)) ** 3).mean(-1, keepdim=True) + 1e-5)
            ),
            "exponent 3",
        ),
        (
            lambda x: (
                (x - x.mean(-1, keepdim=True))
                / torch.sqrt(((x - x.mean(-1, keepdim=True)) ** 2).mean(0, keepdim=True) + 1e-5)
            ),
            "last",
        ),
    ],
    ids=["unbiased", "no-eps", "pow3", "wrong-dim"],
)
def test_layernorm_refuses_near_misses(harness, fn, reason):
    (x,) = _inputs(torch.float32, (6, 32))
    gm = harness.trace(fn, x)
    record = harness.apply(gm, "layernorm")
    assert record.rewritten() == 0
    assert any(reason in d.reason for d in record.refused("layernorm")), record.summary()
    torch.testing.assert_close(gm(x), fn(x), equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_meanvar_pairs_into_var_mean(harness, dtype):
    (x,) = _inputs(dtype, (4, 16, 8))
    fn = lambda x: (x.mean(1), x.var(1) * 2)  # noqa: E731
    gm = harness.trace(fn, x)
    record = harness.apply(gm, "meanvar")
    assert record.rewritten("meanvar") == 1
    assert (
        harness.count(gm, aten.var_mean.correction) == 1 and harness.count(gm, aten.mean.dim) == 0
    )
    for got, ref in zip(gm(x), fn(x), strict=True):
        torch.testing.assert_close(got, ref, **harness.tolerance(dtype))


def test_meanvar_refuses_different_dims(harness):
    (x,) = _inputs(torch.float32, (4, 16, 8))
    gm = harness.trace(lambda x: (x.mean(1), x.var(2)), x)
    record = harness.apply(gm, "meanvar")
    assert "different dims" in record.refused("meanvar")[0].reason
    assert harness.count(gm, aten.var_mean.correction) == 0
