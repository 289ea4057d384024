"""Chunked output head + cross-entropy against the plain one (F.linear + F.cross_entropy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyperparallel.models.lm_loss import chunked_linear_cross_entropy


def _inputs(tokens: int, hidden: int, vocab: int, *, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    b = torch.randn(vocab, generator=gen).requires_grad_() if bias else None
    t = torch.randint(vocab, (tokens,), generator=gen)
    return h, w, b, t


@pytest.mark.parametrize(("chunk_rows", "bias"), [(1, False), (7, True), (64, False), (1000, True)])
def test_equals_plain_head_values_and_gradients(chunk_rows: int, bias: bool):
    h, w, b, t = _inputs(50, 16, 97, bias=bias)
    t[::5] = -100  # ignored positions
    ref = F.cross_entropy(F.linear(h, w, b), t, ignore_index=-100)
    ref_grads = torch.autograd.grad(ref * 3.0, [x for x in (h, w, b) if x is not None])
    out = chunked_linear_cross_entropy(h, w, t, b, chunk_rows=chunk_rows)
    grads = torch.autograd.grad(out * 3.0, [x for x in (h, w, b) if x is not None])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_softcap_matches_capped_logits():
    h, w, b, t = _inputs(40, 16, 33, bias=True)
    cap = 3.0
    ref = F.cross_entropy(cap * torch.tanh(F.linear(h, w, b) / cap), t)
    ref_grads = torch.autograd.grad(ref, (h, w, b))
    out = chunked_linear_cross_entropy(h, w, t, b, chunk_rows=9, softcap=cap)
    grads = torch.autograd.grad(out, (h, w, b))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_leading_shape_and_all_ignored():
    h, w, _, t = _inputs(24, 8, 11, bias=False)
    h3, t3 = h.detach().reshape(2, 12, 8).requires_grad_(), t.reshape(2, 12)
    ref = F.cross_entropy(F.linear(h3, w).flatten(0, 1), t3.flatten())
    torch.testing.assert_close(chunked_linear_cross_entropy(h3, w, t3, chunk_rows=5), ref)
    ignored = torch.full_like(t3, -100)
    loss = chunked_linear_cross_entropy(h3, w, ignored)
    loss.backward()
    assert loss.item() == 0.0 and h3.grad is not None and not h3.grad.any()


def test_bf16_weights_keep_fp32_loss():
    h, w, _, t = _inputs(32, 16, 50, bias=False)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref = F.cross_entropy(F.linear(hb, wb).float(), t)
    out = chunked_linear_cross_entropy(hb, wb, t, chunk_rows=8)
    out.backward()
    assert out.dtype == torch.float32 and wb.grad is not None and wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs (what a long sequence pays for)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_logits_are_never_kept_whole():
    tokens, hidden, vocab = 512, 16, 4096
    h, w, _, t = _inputs(tokens, hidden, vocab, bias=False)
    plain = _saved_bytes(lambda: F.cross_entropy(F.linear(h, w), t))
    chunked = _saved_bytes(lambda: chunked_linear_cross_entropy(h, w, t, chunk_rows=64))
    logits_bytes = tokens * vocab * 4
    assert plain >= logits_bytes  # the plain head keeps the [tokens, vocab] logits (or softmax)
    # the chunked one keeps only gradients shaped like its inputs
    assert chunked == (h.numel() + w.numel()) * 4 + 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target": torch.zeros(3, dtype=torch.long)}, ValueError, "leading shape"),
        ({"target": torch.zeros(4)}, TypeError, "integer class indices"),
        ({"chunk_rows": 0}, ValueError, "chunk_rows must be >= 1"),
        ({"weight": torch.zeros(5, 3)}, ValueError, "hidden size"),
        ({"softcap": 0.0}, ValueError, "softcap must be positive"),
    ],
)
def test_bad_inputs_are_named(kwargs, error, match):
    args = {"hidden": torch.zeros(4, 8), "weight": torch.zeros(5, 8)}
    args["target"] = torch.zeros(4, dtype=torch.long)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        chunked_linear_cross_entropy(**args)
