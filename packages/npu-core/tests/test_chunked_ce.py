"""npu_core.chunked_ce: chunked linear + cross-entropy against the stock head and loss.

The reference is ``F.cross_entropy(F.linear(h, w, b).float(), y, ...)`` and its autograd
gradients; memory is judged from outside the implementation (what autograd saves, and the largest
single allocation the profiler records).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from npu_core.chunked_ce import chunked_linear_cross_entropy


def _inputs(tokens: int, width: int, vocab: int, *, bias: bool, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, width, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, width, generator=gen) / width**0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen).to(dtype).requires_grad_() if bias else None
    t = torch.randint(vocab, (tokens,), generator=gen)
    return h, w, b, t


def _stock(h, w, b, t, softcap=None, **loss_options):
    logits = F.linear(h, w, b).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, t, **loss_options)


def _assert_equal_loss_and_grads(got_fn, want_fn, inputs, upstream=None, **tolerance):
    """Same loss and same gradients of ``sum(loss * upstream)`` for every input given."""
    inputs = [x for x in inputs if x is not None]
    upstream = torch.tensor(1.0) if upstream is None else upstream
    want = want_fn()
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)
    got = got_fn()
    got_grads = torch.autograd.grad((got * upstream).sum(), inputs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **tolerance)
    for g, e in zip(got_grads, want_grads, strict=True):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("chunk_rows", "bias"), [(1, True), (7, False), (64, True), (1000, False)])
def test_values_and_gradients_equal_the_stock_head(chunk_rows, bias, reduction):
    """Every chunk size (one row, uneven chunks, one chunk, larger than the input) and
    reduction: the loss and the gradients of hidden, weight and bias, ignored rows included."""
    h, w, b, t = _inputs(50, 16, 97, bias=bias)
    t[::5] = -100
    options = {"ignore_index": -100, "reduction": reduction}
    _assert_equal_loss_and_grads(
        lambda: chunked_linear_cross_entropy(h, w, t, b, chunk_rows=chunk_rows, **options),
        lambda: _stock(h, w, b, t, **options),
        (h, w, b),
        upstream=torch.rand(50 if reduction == "none" else ()) + 0.5,
    )


def test_another_ignore_index_is_honoured():
    """ignore_index=0 drops class-0 targets; the default -100 would have counted them."""
    h, w, b, t = _inputs(40, 8, 11, bias=True)
    t[:10] = 0
    _assert_equal_loss_and_grads(
        lambda: chunked_linear_cross_entropy(h, w, t, b, ignore_index=0, chunk_rows=6),
        lambda: _stock(h, w, b, t, ignore_index=0),
        (h, w, b),
    )
    assert not torch.allclose(_stock(h, w, b, t, ignore_index=0), _stock(h, w, b, t))


def test_softcap_equals_capped_stock_logits():
    h, w, b, t = _inputs(40, 16, 33, bias=True)
    _assert_equal_loss_and_grads(
        lambda: chunked_linear_cross_entropy(h, w, t, b, softcap=3.0, chunk_rows=9),
        lambda: _stock(h, w, b, t, softcap=3.0),
        (h, w, b),
    )


def test_leading_dims_are_tokens_and_none_keeps_their_shape():
    h, w, _, t = _inputs(24, 8, 11, bias=False)
    h3, t3 = h.detach().reshape(2, 12, 8), t.reshape(2, 12)
    got = chunked_linear_cross_entropy(h3, w, t3, reduction="none", chunk_rows=5)
    assert got.shape == (2, 12)
    want = _stock(h3.flatten(0, 1), w, None, t3.flatten(), reduction="none")
    torch.testing.assert_close(got, want.view(2, 12))


def test_bf16_head_matches_the_stock_bf16_head():
    """bf16 weights and hidden states: fp32 loss, bf16 gradients, within bf16 rounding (the
    chunks' gradients are summed in another order)."""
    h, w, b, t = _inputs(64, 32, 300, bias=True, dtype=torch.bfloat16)
    t[::7] = -100
    _assert_equal_loss_and_grads(
        lambda: chunked_linear_cross_entropy(h, w, t, b, chunk_rows=16),
        lambda: _stock(h, w, b, t),
        (h, w, b),
        rtol=2e-2,
        atol=2e-3,
    )


def test_all_ignored_mean_is_nan_and_sum_is_zero_as_stock():
    h, w, _, _ = _inputs(12, 8, 11, bias=False)
    ignored = torch.full((12,), -100)
    mean = chunked_linear_cross_entropy(h, w, ignored, chunk_rows=5)
    assert torch.isnan(mean) and torch.isnan(_stock(h, w, None, ignored))
    total = chunked_linear_cross_entropy(h, w, ignored, reduction="sum", chunk_rows=5)
    total.backward()
    assert total.item() == 0.0 and h.grad is not None and not h.grad.any()
    assert w.grad is not None and not w.grad.any()


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def _largest_allocation(fn) -> int:
    """The largest single allocation (bytes) any operator makes while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.self_cpu_memory_usage for event in prof.events())


def test_logits_are_never_saved_whole():
    """Autograd keeps the inputs and a [tokens] log-sum-exp, nothing [tokens, vocab]."""
    tokens, width, vocab = 512, 16, 4096
    h, w, _, t = _inputs(tokens, width, vocab, bias=False)
    plain = _saved_bytes(lambda: _stock(h, w, None, t))
    chunked = _saved_bytes(lambda: chunked_linear_cross_entropy(h, w, t, chunk_rows=64))
    assert plain >= tokens * vocab * 4  # the stock head keeps the logits (or their softmax)
    assert chunked == (h.numel() + w.numel() + tokens) * 4 + t.numel() * t.element_size()


def test_no_allocation_holds_more_than_one_chunk_of_logits():
    """Forward and backward: no operator allocates more than [chunk_rows, vocab] fp32, while
    the stock head allocates the whole [tokens, vocab] (what the check would catch)."""
    tokens, width, vocab, chunk = 256, 8, 1000, 16
    h, w, _, t = _inputs(tokens, width, vocab, bias=False)
    stock = _largest_allocation(lambda: _stock(h, w, None, t).backward())
    chunked = _largest_allocation(
        lambda: chunked_linear_cross_entropy(h, w, t, chunk_rows=chunk).backward()
    )
    assert stock >= tokens * vocab * 4
    assert chunked <= chunk * vocab * 4


def test_compiles_whole_with_the_same_result():
    """The custom ops trace (fake implementations, registered autograd): no graph break."""
    h, w, b, t = _inputs(30, 8, 40, bias=True)
    compiled = torch.compile(
        lambda h, w, b, t: chunked_linear_cross_entropy(h, w, t, b, chunk_rows=7),
        backend="aot_eager",
        fullgraph=True,
    )
    _assert_equal_loss_and_grads(
        lambda: compiled(h, w, b, t), lambda: _stock(h, w, b, t), (h, w, b)
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target": torch.zeros(3, dtype=torch.long)}, ValueError, "leading shape"),
        ({"target": torch.zeros(4)}, TypeError, "integer class indices"),
        ({"chunk_rows": 0}, ValueError, "chunk_rows must be >= 1"),
        ({"weight": torch.zeros(5, 3)}, ValueError, "hidden size"),
        ({"weight": torch.zeros(5, 8, dtype=torch.float64)}, ValueError, "cast one"),
        ({"bias": torch.zeros(4)}, ValueError, r"must be \[vocab\] = \[5\]"),
        ({"softcap": 0.0}, ValueError, "softcap must be positive"),
        ({"reduction": "avg"}, ValueError, "choose one of mean, sum, none"),
    ],
)
def test_bad_inputs_are_named(kwargs, error, match):
    args = {"hidden": torch.zeros(4, 8), "weight": torch.zeros(5, 8)}
    args["target"] = torch.zeros(4, dtype=torch.long)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        chunked_linear_cross_entropy(**args)
