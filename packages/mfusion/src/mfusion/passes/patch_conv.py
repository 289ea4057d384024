"""Patch convolution: a 2-D convolution whose patches are cheap to copy, as one GEMM.

ViT, CLIP and most vision transformers embed an image with ``Conv2d(C, D, p, stride=p)``; speech
front ends start with ``Conv2d(1, D, k, stride)`` on a spectrogram. Either way the convolution is
exactly ``patches @ weight.T``, where ``patches`` (im2col) is a copy no larger than about
``(k / stride)^2`` times the input: the image cut into tiles (stride == kernel), or the windows of a
single channel. Inductor on CPU hands such a convolution to oneDNN
and converts layouts around it, which for these shapes costs about twice the copy plus GEMM
(measured with both compiled, one thread: 0.50 vs 0.24 ms for a 64x64 RGB image with 8x8
patches, 0.62 vs 0.36 ms for a 3x3/2 convolution of a 200x80 spectrogram). With several input
channels and any other stride the strided copy costs more than it saves (0.88 vs 4.1 ms for a
3x3/2 convolution over 32 channels; ResNet-18's 1x1/2 shortcut convolutions made the model 2%
slower), so that case is refused. The result is a permuted view in NCHW order: consumers
such as ``flatten(2).transpose(1, 2)`` read the GEMM's [N*H'*W', D] rows directly.

The float sum is reassociated (the GEMM's order, not oneDNN's), as any GEMM change does.

Machine-dependent: this trades one kernel (oneDNN's convolution) for two (a copy and a GEMM)
and does not do less work, so whether it pays depends on the CPU's kernels, ISA level and dtype.
With ``MFusionConfig.patch_conv="auto"`` (the default) each convolution shape the rule admits is
timed on the machine that compiles, both forms compiled by Inductor (``mfusion.passes._measured``,
cached per shape and machine profile), and rewritten only where im2col + GEMM is clearly faster;
:data:`MEASURED`, one machine's per-ISA-level table, is the fallback where timing is switched
off. Other devices (GPUs, NPUs) keep the convolution, which is the graph the user wrote. ``"on"``
applies the shape rule anywhere, ``"off"`` nowhere. The profile and the policy are part of the
pass manager's ``uuid()``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import fx

from mfusion.config import MFusionConfig, PatchConvPolicy
from mfusion.passes._graph import FLOAT_DTYPES, aten, emit, is_op, replace, tensor_val
from mfusion.passes._measured import decide
from mfusion.passes.base import MFusionPass, Refusal, Rewrite
from npu_core.timing import Call

CACHE_KIND = "patch-conv"
"""The im2col-or-not decisions' folder under ``$MFUSION_CACHE_DIR``."""

LABELS = ("im2col + GEMM", "convolution")

TILES = "tiles"
"""stride == kernel: the windows tile the image (ViT/CLIP patch embedding); any channels."""
SINGLE_CHANNEL = "single-channel"
"""One input channel, any stride: windows of a spectrogram (speech front ends)."""

# The fallback where nothing may be timed (NPU_CORE_DECISIONS=cached|fallback): (ISA level of
# mfusion.machine.MachineProfile.isa_level, dtype) -> shape classes measured to pay there on one
# machine, compiled by Inductor at one thread (convolution alone vs the rewritten form alone, and
# whole models). Levels and dtypes not listed keep every convolution in that case.
# Ratios are oneDNN convolution time / im2col + GEMM time, both compiled:
#   AVX-512 BF16 CPU, fp32: 8x8/8 over 3 channels 2.06, 3x3/2 over 1 channel 1.41, 3x3/2 over 32
#     channels 0.46; bf16: 1.87, 1.59, 0.70.
#   Same CPU capped to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), fp32: 1.91, 0.96,
#     0.31; bf16 (emulated): 1.01, 0.52, 1.38, so no bf16 class is listed for AVX2 (the
#     32-channel win is one shape, and the same class lost in fp32 and in ResNet-18).
# Whole models overrule single convolutions: under the AVX2 cap the speech model (its 3x3/2
# single-channel front end) ran 1.30x faster with that convolution rewritten (41 interleaved
# rounds, p25-p75 1.06-1.54) although the convolution alone measured 0.96, so single-channel
# windows are listed for AVX2 fp32. 1x1/2 convolutions over 64-128 channels measured 1.3-2.5
# alone on both levels, but ResNet-18 with its shortcuts rewritten ran 2% slower (AVX-512 BF16,
# fp32): multi-channel strided windows stay refused everywhere (shape_class None).
MEASURED: dict[tuple[str, torch.dtype], frozenset[str]] = {
    ("avx512-bf16", torch.float32): frozenset({TILES, SINGLE_CHANNEL}),
    ("avx512-bf16", torch.bfloat16): frozenset({TILES, SINGLE_CHANNEL}),
    ("avx2", torch.float32): frozenset({TILES, SINGLE_CHANNEL}),
}


def shape_class(channels: int, kernel: tuple[int, ...], stride: tuple[int, ...]) -> str | None:
    """The class a convolution's windows fall in; None for strided windows over several channels
    (overlapping or with gaps), which were measured slower as im2col on every level tried."""
    if stride == kernel:
        return TILES
    if channels == 1:
        return SINGLE_CHANNEL
    return None


def _ints(values: object) -> tuple[int, ...] | None:
    if isinstance(values, list | tuple) and all(type(v) is int for v in values):
        return tuple(values)
    return None


class PatchConvPass(MFusionPass):
    """Anchor on ``convolution(x, w, b, stride, padding, dilation, transposed, _, groups)``."""

    name = "patch_conv"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.convolution.default):
            return None
        x, w, b, stride, padding, dilation, transposed, _, groups = node.args
        vx, vw, vo = tensor_val(x), tensor_val(w), tensor_val(node)
        if vx is None or vw is None or vo is None or vx.dim() != 4:
            return None  # only 2-D convolutions are this pattern
        kernel = _ints(list(vw.shape[2:]))
        if transposed or groups != 1:
            raise Refusal(f"transposed={transposed}, groups={groups}: need a plain convolution")
        shape = _ints(list(vx.shape))
        if shape is None or kernel is None:
            raise Refusal("symbolic input or kernel shape")
        pads, dilations = _ints(padding), _ints(dilation)
        if pads is None or dilations is None:
            raise Refusal(f"padding {padding} / dilation {dilation}: need lists of ints")
        if any(p != 0 for p in pads) or any(d != 1 for d in dilations):
            raise Refusal(f"padding {padding} / dilation {dilation}: need 0 / 1")
        strides = _ints(stride)
        if strides is None or len(strides) != 2 or min(strides) < 1:
            raise Refusal(f"stride {stride}: need two positive ints")
        shape_cls = shape_class(shape[1], kernel, strides)
        if shape_cls is None:
            raise Refusal(
                f"{kernel}/{strides} windows (overlapping or with gaps) over {shape[1]} channels: "
                "the strided im2col copy costs more than the convolution"
            )
        if vx.dtype != vw.dtype or vx.dtype not in FLOAT_DTYPES:
            raise Refusal(f"input/weight dtypes {vx.dtype}/{vw.dtype}: need one floating dtype")
        vb = tensor_val(b)
        if b is not None and (vb is None or vb.dtype != vx.dtype):
            raise Refusal("bias dtype differs from the input's")
        conv = PatchConv(vx.dtype, shape, tuple(vw.shape), strides, b is not None)
        reason = _check_policy(config, shape_cls, conv, vx.device)
        n, c = shape[:2]
        kh, kw = kernel
        ho, wo = vo.shape[2], vo.shape[3]
        out_channels = vw.shape[0]

        def rewrite() -> str:
            graph = node.graph
            # unfold drops a ragged border exactly as the convolution does: [N, C, H', W', kh, kw]
            windows = emit(graph, aten.unfold.default, x, 2, kh, strides[0])
            windows = emit(graph, aten.unfold.default, windows, 3, kw, strides[1])
            windows = emit(graph, aten.permute.default, windows, [0, 2, 3, 1, 4, 5])
            patches = emit(graph, aten.reshape.default, windows, [n * ho * wo, c * kh * kw])
            weight = emit(graph, aten.reshape.default, w, [out_channels, c * kh * kw])
            weight = emit(graph, aten.permute.default, weight, [1, 0])
            if b is None:
                rows = emit(graph, aten.mm.default, patches, weight)
            else:
                rows = emit(graph, aten.addmm.default, b, patches, weight)
            out = emit(graph, aten.view.default, rows, [n, ho, wo, out_channels])
            replace(node, emit(graph, aten.permute.default, out, [0, 3, 1, 2]))
            return (
                f"{kh}x{kw}/{strides[0]}x{strides[1]} convolution {c}->{out_channels} as "
                f"[{n * ho * wo}, {c * kh * kw}] x [{c * kh * kw}, {out_channels}] GEMM{reason}"
            )

        return rewrite


@dataclasses.dataclass(frozen=True)
class PatchConv:
    """One convolution the shape rule admits: everything its timing depends on."""

    dtype: torch.dtype
    input: tuple[int, ...]
    weight: tuple[int, ...]
    stride: tuple[int, ...]
    bias: bool

    def fields(self) -> dict[str, object]:
        return {
            "dtype": str(self.dtype),
            "input": list(self.input),
            "weight": list(self.weight),
            "stride": list(self.stride),
            "bias": self.bias,
        }

    def calls(self) -> tuple[Call, Call]:
        """(im2col + GEMM, the convolution), each compiled by Inductor alone on its first call
        (a test's fake timer never pays for the compiles), on random inputs of these shapes."""
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        from mfusion.mlir.standalone import inductor_compiled

        generator = torch.Generator().manual_seed(0)
        shapes = [self.input, self.weight] + ([self.weight[:1]] if self.bias else [])
        inputs = [torch.randn(s, generator=generator).to(self.dtype) for s in shapes]

        def convolution(x: torch.Tensor, w: torch.Tensor, *b: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.conv2d(x, w, b[0] if b else None, stride=self.stride)

        def gemm(x: torch.Tensor, w: torch.Tensor, *b: torch.Tensor) -> torch.Tensor:
            (kh, kw), (sh, sw) = self.weight[2:], self.stride
            windows = x.unfold(2, kh, sh).unfold(3, kw, sw).permute(0, 2, 3, 1, 4, 5)
            n, ho, wo = windows.shape[:3]
            rows = windows.reshape(n * ho * wo, -1) @ w.reshape(w.shape[0], -1).T
            rows = rows + b[0] if b else rows
            return rows.view(n, ho, wo, -1).permute(0, 3, 1, 2)

        def lazily_compiled(fn: Callable[..., torch.Tensor]) -> Call:
            gm = make_fx(fn, decomposition_table=select_decomp_table())(*inputs)
            kernel = functools.cache(lambda: inductor_compiled(gm, inputs))
            return lambda: kernel()(*inputs)

        return lazily_compiled(gemm), lazily_compiled(convolution)


def _check_policy(
    config: MFusionConfig, shape_cls: str, conv: PatchConv, device: torch.device
) -> str:
    """What lets ``conv`` be rewritten on this machine (appended to the rewrite's note); raise
    :class:`Refusal` where the policy or the measurement keeps the convolution."""
    if config.patch_conv is PatchConvPolicy.ON:
        return ""
    if config.patch_conv is PatchConvPolicy.OFF:
        raise Refusal("disabled by patch_conv='off'")
    if device.type != "cpu":
        raise Refusal(
            f"{shape_cls} convolution on {device.type}: im2col + GEMM was measured on CPU only "
            "(patch_conv='on' forces it)"
        )
    machine = config.resolved_machine()
    level = machine.isa_level
    choice = decide(
        CACHE_KIND,
        conv.fields(),
        machine,
        LABELS,
        conv.calls,
        fallback_chosen=shape_cls in MEASURED.get((level, conv.dtype), frozenset()),
    )
    if not choice.chosen:
        raise Refusal(
            f"{shape_cls} convolution in {conv.dtype} on ISA level {level!r}: not faster here, "
            f"{choice.describe()} ({machine.describe()}; patch_conv='on' forces it)"
        )
    return f": {choice.describe()}"
