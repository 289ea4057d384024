"""The dense attention chain on a CUDA device: which kernel runs, and that its output is right.

The expected backend is derived here from what imports in this process and the GPU's compute
capability, independently of liteboost's constraint tables; outputs are compared with stock
SDPA computed in fp64.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from liteboost import env
from liteboost.attention import backends
from liteboost.attention.backends import AttentionBackend, AttentionCall, select_backend
from npu_core.testing import requires_cuda

pytestmark = [pytest.mark.device, requires_cuda]

BF16_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}
FP32_TOLERANCE = {"atol": 2e-5, "rtol": 1e-4}


def _imports(module: str, attr: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attr)
    except Exception:  # a broken CUDA extension raises more than ImportError
        return False


def _expected_half_backend(capability: tuple[int, int]) -> AttentionBackend:
    """FA3 needs Hopper (sm90) and its Hopper build; FA2 Ampere (sm80); else SDPA."""
    if capability >= (9, 0) and _imports("flash_attn_interface", "flash_attn_func"):
        return AttentionBackend.FA3
    if capability >= (8, 0) and _imports("flash_attn", "flash_attn_func"):
        return AttentionBackend.FA2
    return AttentionBackend.SDPA


@pytest.fixture
def ran(monkeypatch) -> list[AttentionBackend]:
    """The backends whose kernels flash_attention actually fetched, in call order."""
    monkeypatch.delenv(env.ATTENTION_BACKEND, raising=False)
    backends.installed_backends()  # probe (and cache) before spying: only calls are recorded
    calls: list[AttentionBackend] = []
    original = backends._kernel

    def spy(backend: AttentionBackend):
        calls.append(backend)
        return original(backend)

    monkeypatch.setattr(backends, "_kernel", spy)
    return calls


def _qkv(dtype, heads=4, seq=1024, head_dim=128, seed=0):
    """[B, S, N, D] (BSND, the layout FlashAttention and Wan use) on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seq, heads, head_dim, generator=gen).to("cuda", dtype) for _ in range(3)]


def _sdpa_fp64(q, k, v):
    """Stock SDPA in fp64 on BSND inputs, cast back to the inputs' dtype."""
    out = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2).to(q.dtype)


def test_fp32_never_reaches_flash_attention(ran):
    """fp32 runs SDPA even if every FlashAttention build were installed; output is exact."""
    q, k, v = _qkv(torch.float32)
    call = AttentionCall.of(q, k, v)
    assert call.device == "cuda" and call.capability == torch.cuda.get_device_capability()
    assert select_backend(call, installed=frozenset(AttentionBackend)) is AttentionBackend.SDPA
    out = backends.flash_attention(q, k, v)
    assert ran == [AttentionBackend.SDPA]
    torch.testing.assert_close(out, _sdpa_fp64(q, k, v), **FP32_TOLERANCE)


def test_bf16_picks_best_installed_backend_and_equals_sdpa(ran, record_property):
    """bf16 on this GPU goes to the first installed FlashAttention it supports, else SDPA."""
    capability = torch.cuda.get_device_capability()
    q, k, v = _qkv(torch.bfloat16)
    expected = _expected_half_backend(capability)
    assert select_backend(AttentionCall.of(q, k, v)) is expected
    out = backends.flash_attention(q, k, v)
    assert ran == [expected]
    torch.testing.assert_close(out, _sdpa_fp64(q, k, v), **BF16_TOLERANCE)
    # Availability injected: what this GPU's capability allows if both builds were present.
    both = frozenset({AttentionBackend.FA3, AttentionBackend.FA2, AttentionBackend.SDPA})
    if capability >= (9, 0):
        hardware_best = AttentionBackend.FA3
    elif capability >= (8, 0):
        hardware_best = AttentionBackend.FA2
    else:
        hardware_best = AttentionBackend.SDPA
    assert select_backend(AttentionCall.of(q, k, v), installed=both) is hardware_best
    record_property("bf16_backend", expected.value)
    record_property("capability", ".".join(map(str, capability)))


def test_head_dim_above_flash_limit_runs_sdpa(ran):
    """Head dim 512 is beyond FlashAttention's 256: SDPA runs, output correct."""
    q, k, v = _qkv(torch.bfloat16, heads=2, seq=256, head_dim=512)
    out = backends.flash_attention(q, k, v)
    assert ran == [AttentionBackend.SDPA]
    torch.testing.assert_close(out, _sdpa_fp64(q, k, v), **BF16_TOLERANCE)


@pytest.mark.parametrize("backend", [AttentionBackend.FA3, AttentionBackend.FA2])
def test_each_installed_flash_build_equals_sdpa(backend, ran):
    """Every installed FlashAttention build this GPU supports, forced, equals SDPA in BSND and
    BNSD layouts."""
    capability = torch.cuda.get_device_capability()
    if backend not in backends.installed_backends():
        pytest.skip(f"{backend.value} is not installed here")
    if backend is AttentionBackend.FA3 and capability < (9, 0):
        pytest.skip(f"fa3 needs sm90, this GPU is sm{capability[0]}{capability[1]}")
    q, k, v = _qkv(torch.bfloat16, seed=3)
    ref = _sdpa_fp64(q, k, v)
    out = backends.flash_attention(q, k, v, backend=backend)
    torch.testing.assert_close(out, ref, **BF16_TOLERANCE)
    bnsd = [t.transpose(1, 2) for t in (q, k, v)]
    out = backends.flash_attention(*bnsd, layout="BNSD", backend=backend)
    torch.testing.assert_close(out.transpose(1, 2), ref, **BF16_TOLERANCE)
    assert ran == [backend, backend]
