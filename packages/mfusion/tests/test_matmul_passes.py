"""MatMul/BMM rewrites: cast, bias and transpose absorption, BMM batch 1, K=1, reshape-bias."""

from __future__ import annotations

import pytest
import torch

from mfusion.machine import MachineProfile
from npu_core import capability

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]


def _randn(dtype, *shapes):
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def test_cast_absorption_runs_bf16_matmul(harness):
    """mm(a.float(), b.float()).to(bf16) becomes one bf16 mm with no casts (native bf16 CPU)."""
    a, b = _randn(torch.bfloat16, (16, 32), (32, 8))
    fn = lambda a, b: (a.float() @ b.float()).to(torch.bfloat16)  # noqa: E731
    gm = harness.trace(fn, a, b)
    record = harness.apply(gm, "matmul_cast", machine=harness.AVX512_BF16)
    assert record.rewritten("matmul_cast") == 1
    assert harness.count(gm, aten._to_copy.default) == 0 and harness.count(gm, aten.mm.default) == 1
    torch.testing.assert_close(gm(a, b), fn(a, b), **harness.tolerance(torch.bfloat16))


def test_cast_absorption_respects_flag_and_mixed_dtypes(harness):
    a, b = _randn(torch.bfloat16, (4, 8), (8, 4))
    fn = lambda a, b: (a.float() @ b.float()).to(torch.bfloat16)  # noqa: E731
    record = harness.apply(harness.trace(fn, a, b), "matmul_cast", absorb_matmul_casts=False)
    assert "absorb_matmul_casts=False" in record.refused("matmul_cast")[0].reason
    mixed = lambda a, b: (a.float() @ b.half().float()).to(torch.bfloat16)  # noqa: E731
    record = harness.apply(harness.trace(mixed, a, b), "matmul_cast", machine=harness.AVX512_BF16)
    assert "round trip" in record.refused("matmul_cast")[0].reason


@pytest.mark.parametrize(
    ("machine", "dtype", "native"),
    [
        (("AVX512_BF16", {}), torch.bfloat16, True),
        (("AVX2", {}), torch.bfloat16, False),
        # The flag is there but the timing said no (oneDNN capped to AVX2, a container's model).
        (("AVX512_BF16", {"fast_bf16_gemm": False}), torch.bfloat16, False),
        (("AVX512_BF16", {}), torch.float16, False),
        (("AVX512_BF16", {"fast_fp16_gemm": True}), torch.float16, True),
    ],
    ids=["avx512-bf16", "avx2", "bf16-measured-slow", "fp16-slow", "fp16-fast"],
)
def test_cast_absorption_only_where_the_cpu_multiplies_low_precision_natively(
    harness, machine, dtype, native
):
    """Without native bf16/fp16 units the low-precision GEMM is emulated (~100x slower than fp32
    on AVX2), so the casts and the fp32 GEMM stay; the output equals eager either way."""
    machine = harness.machine(*machine)
    a, b = _randn(dtype, (16, 32), (32, 8))
    fn = lambda a, b: (a.float() @ b.float()).to(dtype)  # noqa: E731
    gm = harness.trace(fn, a, b)
    record = harness.apply(gm, "matmul_cast", machine=machine)
    assert record.rewritten("matmul_cast") == int(native)
    assert harness.count(gm, aten._to_copy.default) == (0 if native else 3)
    if not native:
        assert "no native" in record.refused("matmul_cast")[0].reason
    torch.testing.assert_close(gm(a, b), fn(a, b), **harness.tolerance(torch.bfloat16))


def test_detected_machine_profile_matches_torch_and_npu_core():
    """detect() reports what torch and npu_core.capability say for this process, whatever the
    machine is (the GEMM answers are npu_core's measured ones)."""
    profile = MachineProfile.detect()
    assert profile.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert profile.threads == torch.get_num_threads()
    assert profile.fast_bf16_gemm == capability.fast_matmul("cpu", torch.bfloat16)
    assert profile.native_cpu_gemm(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_absorption_into_addmm(harness, dtype):
    x, w, b = _randn(dtype, (8, 16), (16, 12), (12,))
    fn = lambda x, w, b: x @ w + b  # noqa: E731
    gm = harness.trace(fn, x, w, b)
    record = harness.apply(gm, "matmul_bias")
    assert record.rewritten("matmul_bias") == 1
    assert harness.count(gm, aten.addmm.default) == 1 and harness.count(gm, aten.add.Tensor) == 0
    torch.testing.assert_close(gm(x, w, b), fn(x, w, b), **harness.tolerance(dtype))


def test_bias_absorption_refuses_dtype_mismatch_and_reuse(harness):
    x, w = _randn(torch.float32, (8, 16), (16, 12))
    b = torch.randn(12, dtype=torch.float64)
    record = harness.apply(harness.trace(lambda x, w, b: x @ w + b, x, w, b), "matmul_bias")
    assert "dtype" in record.refused("matmul_bias")[0].reason

    def reused(x, w, b):
        product = x @ w
        return product + b, product

    record = harness.apply(harness.trace(reused, x, w, b.float()), "matmul_bias")
    assert "also used" in record.refused("matmul_bias")[0].reason


@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_absorption_drops_contiguous_copy(harness, dtype):
    x, w = _randn(dtype, (8, 16), (12, 16))
    fn = lambda x, w: x @ w.t().contiguous()  # noqa: E731
    gm = harness.trace(fn, x, w)
    assert harness.count(gm, aten.clone.default) == 1
    record = harness.apply(gm, "matmul_transpose")
    assert record.rewritten("matmul_transpose") == 1
    assert harness.count(gm, aten.clone.default) == 0
    torch.testing.assert_close(gm(x, w), fn(x, w), **harness.tolerance(dtype))


def test_transpose_absorption_leaves_other_permutes(harness):
    """A batched permute that is not a last-two-dims swap keeps its copy."""
    q, k = _randn(torch.float32, (2, 4, 8), (4, 2, 8))
    fn = lambda q, k: torch.bmm(q, k.permute(1, 2, 0).contiguous())  # noqa: E731
    gm = harness.trace(fn, q, k)
    record = harness.apply(gm, "matmul_transpose")
    assert record.matched() == 0 and harness.count(gm, aten.clone.default) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_batch_one_becomes_mm(harness, dtype):
    a, b = _randn(dtype, (1, 8, 16), (1, 16, 4))
    gm = harness.trace(torch.bmm, a, b)
    record = harness.apply(gm, "bmm_to_mm")
    assert record.rewritten("bmm_to_mm") == 1
    assert harness.count(gm, aten.bmm.default) == 0 and harness.count(gm, aten.mm.default) == 1
    torch.testing.assert_close(gm(a, b), torch.bmm(a, b), **harness.tolerance(dtype))


def test_bmm_batch_two_untouched_and_symbolic_batch_refused(harness):
    a, b = _randn(torch.float32, (2, 8, 16), (2, 16, 4))
    record = harness.apply(harness.trace(torch.bmm, a, b), "bmm_to_mm")
    assert record.matched() == 0
    record = harness.apply(harness.trace(torch.bmm, a, b, mode="symbolic"), "bmm_to_mm")
    assert "symbolic" in record.refused("bmm_to_mm")[0].reason


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batched", [False, True])
def test_k1_matmul_becomes_broadcast_multiply(harness, batched, dtype):
    shapes = ((3, 8, 1), (3, 1, 5)) if batched else ((8, 1), (1, 5))
    a, b = _randn(dtype, *shapes)
    fn = torch.bmm if batched else torch.mm
    gm = harness.trace(fn, a, b)
    record = harness.apply(gm, "k1_matmul")
    assert record.rewritten("k1_matmul") == 1
    assert harness.count(gm, aten.bmm.default if batched else aten.mm.default) == 0
    assert harness.count(gm, aten.mul.Tensor) == 1
    torch.testing.assert_close(gm(a, b), fn(a, b), **harness.tolerance(dtype))


def test_k1_matmul_ignores_k2(harness):
    a, b = _randn(torch.float32, (8, 2), (2, 5))
    assert harness.apply(harness.trace(torch.mm, a, b), "k1_matmul").matched() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_reshape_bias_reorders_into_addmm(harness, dtype):
    x, w, b = _randn(dtype, (6, 16), (16, 12), (12,))
    fn = lambda x, w, b: (x @ w).view(2, 3, 12) + b  # noqa: E731
    gm = harness.trace(fn, x, w, b)
    record = harness.apply(gm, "matmul_reshape_bias")
    assert record.rewritten("matmul_reshape_bias") == 1
    assert harness.count(gm, aten.addmm.default) == 1 and harness.count(gm, aten.add.Tensor) == 0
    torch.testing.assert_close(gm(x, w, b), fn(x, w, b), **harness.tolerance(dtype))


def test_matmul_reshape_bias_refuses_bias_along_reshaped_dim(harness):
    x, w, b = _randn(torch.float32, (6, 16), (16, 12), (3, 12))
    fn = lambda x, w, b: (x @ w).view(2, 3, 12) + b  # noqa: E731
    gm = harness.trace(fn, x, w, b)
    record = harness.apply(gm, "matmul_reshape_bias")
    assert "varies along reshaped dims" in record.refused("matmul_reshape_bias")[0].reason
    torch.testing.assert_close(gm(x, w, b), fn(x, w, b))


def test_matmul_reshape_bias_with_symbolic_batch(harness):
    """With dynamic shapes the reshape keeps its symbolic sizes and works for other batches."""
    x, w, b = _randn(torch.float32, (6, 16), (16, 12), (12,))

    def fn(x, w, b):
        return (x @ w).view(x.shape[0] // 3, 3, 12) + b

    gm = harness.trace(fn, x, w, b, mode="symbolic")
    record = harness.apply(gm, "matmul_reshape_bias")
    assert record.rewritten("matmul_reshape_bias") == 1
    x9 = torch.randn(9, 16)
    torch.testing.assert_close(gm(x9, w, b), fn(x9, w, b))
