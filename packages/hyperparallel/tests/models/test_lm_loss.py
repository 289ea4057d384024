"""The transformers models' head loss against the plain one (F.linear + F.cross_entropy).

The chunked computation itself is tested in npu-core (memory, reductions, compile); here what
hyperparallel relies on: the mean it trains on, softcap passed through, and 0 for a batch whose
targets are all ignored."""

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
