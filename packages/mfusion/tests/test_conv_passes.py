"""Patch convolution: non-overlapping (ViT) and single-channel (speech) convolutions as a GEMM."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import mfusion
from mfusion.machine import MachineProfile
from npu_core.timing import use_timer

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _decisions(monkeypatch, tmp_path):
    """patch_conv='auto' takes its MEASURED fallback table unless a test measures (a fresh cache
    per test)."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "fallback")
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))


def _randn(dtype, *shapes):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def _conv(**kwargs):
    return lambda x, w, b: F.conv2d(x, w, b, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vit_patch_embedding_becomes_one_gemm(harness, dtype):
    """8x8 patches with stride 8 over RGB, bias, ragged border (66 rows): one addmm, same values."""
    x, w, b = _randn(dtype, (2, 3, 66, 64), (16, 3, 8, 8), (16,))
    fn = _conv(stride=8)
    gm = harness.trace(fn, x, w, b)
    record = harness.apply(gm, "patch_conv", patch_conv="on")
    assert record.rewritten("patch_conv") == 1
    assert (
        harness.count(gm, aten.convolution.default) == 0
        and harness.count(gm, aten.addmm.default) == 1
    )
    out = gm(x, w, b)
    assert out.shape == (2, 16, 8, 8)
    torch.testing.assert_close(out, fn(x, w, b), **harness.tolerance(dtype) | {"atol": 5e-2})
    # What a ViT does next: flatten the grid and put tokens first.
    torch.testing.assert_close(
        out.flatten(2).transpose(1, 2), fn(x, w, b).flatten(2).transpose(1, 2), atol=5e-2, rtol=0
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_channel_overlapping_windows_become_one_gemm(harness, dtype):
    """A speech front end: 3x3 windows with stride 2 over one channel, no bias, odd sizes."""
    x, w = _randn(dtype, (2, 1, 41, 17), (8, 1, 3, 3))
    fn = lambda x, w: F.conv2d(x, w, None, stride=2)  # noqa: E731
    gm = harness.trace(fn, x, w)
    record = harness.apply(gm, "patch_conv", patch_conv="on")
    assert record.rewritten("patch_conv") == 1
    assert (
        harness.count(gm, aten.convolution.default) == 0 and harness.count(gm, aten.mm.default) == 1
    )
    torch.testing.assert_close(gm(x, w), fn(x, w), **harness.tolerance(dtype) | {"atol": 5e-2})


@pytest.mark.parametrize(
    ("shapes", "kwargs", "reason"),
    [
        (((1, 3, 16, 16), (4, 3, 3, 3), (4,)), {"stride": 2}, "overlapping"),
        (((1, 8, 16, 16), (4, 8, 1, 1), (4,)), {"stride": 2}, "gaps"),
        (((1, 3, 16, 16), (4, 3, 4, 4), (4,)), {"stride": 4, "padding": 1}, "padding"),
        (((1, 1, 16, 16), (4, 1, 3, 3), (4,)), {"stride": 1, "dilation": 2}, "dilation"),
        (((1, 4, 16, 16), (4, 2, 4, 4), (4,)), {"stride": 4, "groups": 2}, "groups=2"),
    ],
)
def test_refuses_convolutions_that_are_not_cheap_patches(harness, shapes, kwargs, reason):
    x, w, b = _randn(torch.float32, *shapes)
    gm = harness.trace(_conv(**kwargs), x, w, b)
    record = harness.apply(gm, "patch_conv", patch_conv="on")
    assert record.rewritten("patch_conv") == 0
    assert reason in record.refused("patch_conv")[0].reason
    assert harness.count(gm, aten.convolution.default) == 1


def test_stride_larger_than_kernel_skips_the_same_pixels(harness):
    """2x2 windows every 3 pixels over one channel: tiles with gaps, like the convolution."""
    x, w, b = _randn(torch.float32, (1, 1, 17, 16), (4, 1, 2, 2), (4,))
    fn = _conv(stride=3)
    gm = harness.trace(fn, x, w, b)
    assert harness.apply(gm, "patch_conv", patch_conv="on").rewritten("patch_conv") == 1
    torch.testing.assert_close(gm(x, w, b), fn(x, w, b), **harness.tolerance(torch.float32))


def test_transposed_and_1d_convolutions_untouched(harness):
    x, w = _randn(torch.float32, (1, 4, 5, 5), (4, 2, 2, 2))
    record = harness.apply(
        harness.trace(lambda x, w: F.conv_transpose2d(x, w, stride=2), x, w),
        "patch_conv",
        patch_conv="on",
    )
    assert "transposed=True" in record.refused("patch_conv")[0].reason
    x1, w1 = _randn(torch.float32, (1, 2, 16), (4, 2, 4))
    record = harness.apply(
        harness.trace(lambda x, w: F.conv1d(x, w, stride=4), x1, w1), "patch_conv", patch_conv="on"
    )
    assert record.rewritten("patch_conv") == 0 and not record.refused("patch_conv")


@pytest.mark.slow
def test_compiled_patch_embedding_matches_eager(harness):
    """Through torch.compile: Inductor lowers the emitted unfold/permute/addmm and the permuted
    NCHW view feeds flatten + transpose + LayerNorm like in a ViT."""

    class PatchEmbed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Conv2d(3, 32, 8, 8)
            self.norm = torch.nn.LayerNorm(32)

        def forward(self, images):
            return self.norm(self.proj(images).flatten(2).transpose(1, 2))

    torch.manual_seed(0)
    model, x = PatchEmbed().eval(), torch.randn(2, 3, 32, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        opts = mfusion.compile_options(
            backend="inductor", passes=["patch_conv"], auto_fuse=False, machine=harness.AVX2
        )
        out = torch.compile(model, options=opts)(x)
        ref = model(x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert mfusion.report().rewritten("patch_conv") == 1


def _case(kind: str, dtype: torch.dtype = torch.float32):
    if kind == "tiles":  # ViT patch embedding: 4x4/4 over RGB
        return _conv(stride=4), _randn(dtype, (1, 3, 16, 16), (8, 3, 4, 4), (8,))
    if kind == "single":  # speech front end: 3x3/2 over one channel
        return _conv(stride=2), _randn(dtype, (1, 1, 17, 15), (8, 1, 3, 3), (8,))
    # overlapping strided windows over several channels (ResNet-style 3x3/2)
    return _conv(stride=2), _randn(dtype, (1, 4, 17, 15), (8, 4, 3, 3), (8,))


# Machine profiles: the two fixed ones, AVX-512 capped to AVX2 (oneDNN's cap), and profiles
# whose ISA level nothing was measured on (unknown cap, AMX, AVX-512 without BF16, ARM).
PROFILES = {
    "avx512-bf16": ("AVX512_BF16", {}),
    "avx2": ("AVX2", {}),
    "onednn-cap-avx2": ("AVX512_BF16", {"onednn_max_isa": "AVX2"}),
    "unknown-cap": ("AVX512_BF16", {"onednn_max_isa": "nonsense"}),
    "amx": ("AVX512_BF16", {"amx": True}),
    "avx512-no-bf16": ("AVX512_BF16", {"avx512_bf16": False}),
    "arm": ("AVX2", {"arch": "aarch64", "cpu_capability": "SVE256"}),
}
UNMEASURED = ("unknown-cap", "amx", "avx512-no-bf16", "arm")


def test_auto_policy_decides_by_isa_level_and_dtype_within_what_on_allows(harness):
    """patch_conv='auto' by behaviour, not by its table: it rewrites a subset of what 'on'
    rewrites (tiles and single-channel windows, never overlapping multi-channel ones), equals
    eager, decides the same for profiles of one ISA level, names the level and dtype when it
    keeps a convolution, keeps every convolution where nothing was measured, and rewrites
    both shape classes somewhere."""
    decisions: dict[tuple, set[bool]] = {}
    rewritten_somewhere = set()
    for profile, (base, overrides) in PROFILES.items():
        machine = harness.machine(base, overrides)
        for kind in ("tiles", "single", "strided"):
            for dtype in DTYPES:
                fn, (x, w, b) = _case(kind, dtype)
                forced = harness.apply(
                    harness.trace(fn, x, w, b), "patch_conv", patch_conv="on", machine=machine
                )
                assert forced.rewritten("patch_conv") == (kind != "strided"), (profile, kind)
                gm = harness.trace(fn, x, w, b)
                record = harness.apply(gm, "patch_conv", machine=machine)
                auto = record.rewritten("patch_conv") == 1
                assert harness.count(gm, aten.convolution.default) == (0 if auto else 1)
                assert not auto or kind != "strided", (profile, kind, dtype)
                if not auto and kind != "strided":
                    reason = record.refused("patch_conv")[0].reason
                    assert f"{dtype} on ISA level {machine.isa_level!r}" in reason, reason
                if profile in UNMEASURED:
                    assert not auto, f"{profile}: nothing measured there, the graph is kept"
                torch.testing.assert_close(gm(x, w, b), fn(x, w, b), **harness.tolerance(dtype))
                decisions.setdefault((machine.isa_level, kind, dtype), set()).add(auto)
                if auto:
                    rewritten_somewhere.add(kind)
    assert all(len(d) == 1 for d in decisions.values()), decisions
    assert rewritten_somewhere == {"tiles", "single"}, rewritten_somewhere


def test_auto_policy_keeps_unmeasured_dtypes_and_off_keeps_everything(harness):
    x, w, b = _randn(torch.float64, (1, 3, 16, 16), (8, 3, 4, 4), (8,))
    record = harness.apply(
        harness.trace(_conv(stride=4), x, w, b), "patch_conv", machine=harness.AVX512_BF16
    )
    assert record.rewritten("patch_conv") == 0
    assert "torch.float64" in record.refused("patch_conv")[0].reason
    # bf16 tiles pay with AVX-512 BF16 (1.87x) but not with emulated bf16 on AVX2 (1.01x).
    x, w, b = (t.to(torch.bfloat16) for t in (x, w, b))
    record = harness.apply(
        harness.trace(_conv(stride=4), x, w, b), "patch_conv", machine=harness.AVX512_BF16
    )
    assert record.rewritten("patch_conv") == 1
    record = harness.apply(
        harness.trace(_conv(stride=4), x, w, b), "patch_conv", machine=harness.AVX2
    )
    assert "torch.bfloat16 on ISA level 'avx2'" in record.refused("patch_conv")[0].reason
    fn, (x, w, b) = _case("tiles")
    record = harness.apply(
        harness.trace(fn, x, w, b), "patch_conv", patch_conv="off", machine=harness.AVX512_BF16
    )
    assert "patch_conv='off'" in record.refused("patch_conv")[0].reason


def test_auto_policy_keeps_convolutions_off_cpu(harness):
    """A graph on another device (meta here, standing in for a GPU) keeps its convolution."""
    fn, (x, w, b) = _case("tiles")
    x, w, b = (t.to("meta") for t in (x, w, b))
    record = harness.apply(harness.trace(fn, x, w, b), "patch_conv", machine=harness.AVX512_BF16)
    assert "measured on CPU only" in record.refused("patch_conv")[0].reason


def test_patch_conv_policy_is_validated():
    with pytest.raises(ValueError, match="patch_conv='sometimes' is not known"):
        mfusion.MFusionConfig(patch_conv="sometimes")
    with pytest.raises(ValueError, match="MachineProfile"):
        mfusion.MFusionConfig(machine="avx2")
    assert isinstance(MachineProfile.detect().isa_level, str)


@pytest.mark.parametrize(("gemm_s", "rewritten"), [(0.5e-3, 1), (0.99e-3, 0)])
def test_auto_policy_measures_on_this_machine_and_caches(
    harness, monkeypatch, tmp_path, gemm_s, rewritten
):
    """Measuring on: a shape class the table refuses (bf16 tiles on AVX2) is rewritten where
    im2col + GEMM is timed clearly faster, and kept within MIN_GAIN; both forms compute the same
    convolution; the answer is read back for the same shape and profile."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "measure")
    fn, (x, w, b) = _case("tiles", torch.bfloat16)
    timer = harness.fixed_timer(gemm_s, 1.0e-3)

    def checked(calls):
        gemm, convolution = (call() for call in calls.values())
        torch.testing.assert_close(gemm, convolution, **harness.tolerance(torch.bfloat16))
        return timer(calls)

    with use_timer(checked):
        record = harness.apply(harness.trace(fn, x, w, b), "patch_conv", machine=harness.AVX2)
    assert record.rewritten("patch_conv") == rewritten and timer.calls == 1
    if not rewritten:
        assert "not faster here" in record.refused("patch_conv")[0].reason
    assert len(list((tmp_path / "patch-conv").glob("*.json"))) == 1
    with use_timer(harness.failing_timer):
        gm = harness.trace(fn, x, w, b)
        again = harness.apply(gm, "patch_conv", machine=harness.AVX2)
    assert again.rewritten("patch_conv") == rewritten
    torch.testing.assert_close(gm(x, w, b), fn(x, w, b), **harness.tolerance(torch.bfloat16))
