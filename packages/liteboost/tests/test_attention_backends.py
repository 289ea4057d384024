"""The dense attention chain: declared constraints decide, with availability injected.

Nothing here depends on what is installed or on the device: calls are described by
``AttentionCall`` and ``installed`` is passed explicitly, except for the end-to-end SDPA check,
which compares against stock ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import liteboost
from liteboost.attention.backends import (
    AttentionBackend,
    AttentionCall,
    forced_backend,
    select_backend,
)

ALL = frozenset(AttentionBackend)
B = AttentionBackend


def call(device="cuda", dtype=torch.bfloat16, head_dim=128, value_head_dim=None, cap=(9, 0)):
    return AttentionCall(
        device=device,
        dtype=dtype,
        head_dim=head_dim,
        value_head_dim=head_dim if value_head_dim is None else value_head_dim,
        capability=cap if device == "cuda" else None,
    )


@pytest.mark.parametrize(
    ("described", "installed", "expected"),
    [
        (call(), ALL, B.FA3),
        (call(cap=(8, 0)), ALL, B.FA2),  # FA3 needs Hopper
        (call(cap=(7, 5)), ALL, B.SDPA),  # FA2 needs Ampere
        (call(), ALL - {B.FA3}, B.FA2),
        (call(), {B.SDPA}, B.SDPA),
        (call(dtype=torch.float16), ALL, B.FA3),
        (call(dtype=torch.float32), ALL, B.SDPA),  # FlashAttention takes fp16/bf16 only
        (call(head_dim=512), ALL, B.SDPA),
        (call(value_head_dim=64, cap=(8, 6)), ALL, B.SDPA),  # FA2: v head dim must equal q's
        (call(device="npu"), ALL, B.NPU),
        (call(device="npu", dtype=torch.float32), ALL, B.SDPA),
        (call(device="cpu"), ALL, B.SDPA),
        (call(device="cpu", dtype=torch.float32), ALL, B.SDPA),
    ],
)
def test_chain_picks_the_first_installed_backend_that_accepts_the_call(
    described, installed, expected
):
    assert select_backend(described, installed=installed) is expected


def test_no_backend_for_mixed_dtypes_lists_every_reason():
    mixed = AttentionCall("cuda", None, 64, 64, (9, 0))
    with pytest.raises(ValueError, match=r"fa3: q, k and v have different dtypes.*sdpa: q, k"):
        select_backend(mixed, installed=ALL)


@pytest.mark.parametrize(
    ("forced", "described", "match"),
    [
        (B.FA2, call(dtype=torch.float32), r"'fa2' cannot run this call: dtype float32 \(allowed"),
        (B.FA3, call(head_dim=320), r"'fa3' cannot run this call: head dim 320 \(allowed: at most"),
        (B.FA3, call(cap=(8, 0)), r"capability \(8, 0\) \(allowed: >= 9.0\)"),
        (B.NPU, call(device="cpu"), r"'npu' cannot run this call: device 'cpu' \(allowed: npu\)"),
    ],
)
def test_forced_backend_that_refuses_the_call_raises(forced, described, match):
    with pytest.raises(ValueError, match=match):
        select_backend(described, forced, installed=ALL)


def test_forced_backend_that_is_not_installed_raises():
    with pytest.raises(ValueError, match="'fa2' cannot run this call: not installed"):
        select_backend(call(), B.FA2, installed={B.SDPA})


def test_attention_backend_override_by_environment(monkeypatch):
    monkeypatch.delenv("LITEBOOST_ATTENTION_BACKEND", raising=False)
    assert forced_backend() is None
    assert forced_backend("FA2") is B.FA2
    monkeypatch.setenv("LITEBOOST_ATTENTION_BACKEND", "fa2")
    assert forced_backend() is B.FA2
    assert forced_backend("sdpa") is B.SDPA  # the argument wins
    monkeypatch.setenv("LITEBOOST_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LITEBOOST_ATTENTION_BACKEND='bogus'"):
        forced_backend()


def test_call_description_reads_the_tensors():
    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 7, 2, 8)
    described = AttentionCall.of(q, k, torch.randn(1, 7, 2, 4))
    assert described == AttentionCall("cpu", torch.float32, 8, 4)
    assert AttentionCall.of(q, k, torch.randn(1, 7, 2, 8).half()).dtype is None
    with pytest.raises(ValueError, match="same head dim"):
        AttentionCall.of(q, torch.randn(1, 7, 2, 6), torch.randn(1, 7, 2, 8))


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_calls_equal_stock_sdpa(layout, dtype, monkeypatch):
    """On CPU every call runs SDPA (whatever is installed), in either layout."""
    monkeypatch.delenv("LITEBOOST_ATTENTION_BACKEND", raising=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=gen).to(dtype) for _ in range(3))  # BNSD
    expected = F.scaled_dot_product_attention(q, k, v)
    if layout == "BSND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        expected = expected.transpose(1, 2)
    assert torch.equal(liteboost.flash_attention(q, k, v, layout=layout), expected)
