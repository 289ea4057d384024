"""The block-sparse attention kernels as registered plug-ins, chosen by ``npu_core.plugins``' rule.

Each kernel declares what it takes (device, dtype, whether it has a backward) and where the
chain may pick it unasked; one registry chooses, in priority order, the first installed kernel
that accepts the call, logs each distinct choice once, and refuses a forced kernel that cannot
take the call. The dense attention backends (``liteboost.attention.backends``) follow the same
pattern. Measured preferences behind the order: on CPU the fused kernel beats block gather and
FlexAttention at sparsity 0.8 (``benchmarks/sparse_attention.py``); on CUDA FlexAttention is a
fused Triton kernel.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from liteboost.ops.block_gather import gather_block_sparse_attention
from liteboost.ops.blocks import BlockSize
from liteboost.ops.flex import flex_block_sparse_attention
from liteboost.ops.fused_cpu import fused_cpu_block_sparse_attention
from liteboost.ops.npu_kernel import npu_block_sparse_attention, npu_op
from liteboost.ops.reference import reference_block_sparse_attention
from npu_core.plugins import DeviceDtype, Plugin, Registry

SparseKernelFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BlockSize, float | None],
    torch.Tensor,
]
"""(q, k, v, block_index, block_size, scale) -> out, all BNSD."""


class SparseKernel(enum.StrEnum):
    """Names of the registered kernels (what ``kernel=`` and ``sparse_kernel=`` accept)."""

    NPU = "npu"
    CPU = "cpu"
    GATHER = "gather"
    FLEX = "flex"
    REFERENCE = "reference"


@dataclass(frozen=True)
class SparseCall:
    """The facts of one block-sparse call the constraints look at.

    Attributes:
        device: device type of q, k, v.
        dtype: their dtype.
        requires_grad: autograd records the call (a kernel without backward cannot take it).
        forced: the caller named the kernel (then ``auto_devices`` does not apply).
    """

    device: str
    dtype: torch.dtype
    requires_grad: bool = False
    forced: bool = False

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forced: bool) -> SparseCall:
        """Describe a call on BNSD tensors (already checked to share device and dtype)."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return cls(q.device.type, q.dtype, grad, forced)


@dataclass(frozen=True)
class SparseConstraints(DeviceDtype):
    """Device, dtype and backward, plus where the chain may choose the kernel unasked.

    Attributes:
        auto_devices: device types on which an unforced call may get this kernel; None for all
            of ``devices``, () for none (forced only).
    """

    auto_devices: tuple[str, ...] | None = None

    def rejection(self, call: SparseCall) -> str | None:
        reason = super().rejection(call)
        if reason is not None or call.forced or self.auto_devices is None:
            return reason
        if call.device not in self.auto_devices:
            where = ", ".join(self.auto_devices) or "nowhere"
            return f"not chosen unasked on {call.device!r} (chosen on: {where}; force it by name)"
        return None


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TRITON_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

SPARSE_KERNELS: Registry[SparseKernelFn, SparseCall] = Registry("sparse attention kernel")
"""Every block-sparse kernel; :func:`select_kernel` chooses among them."""


def _npu_installed() -> str | None:
    return None if npu_op() is not None else "torch_npu with npu_rain_fusion_attention missing"


_PLUGINS: tuple[Plugin[SparseKernelFn, SparseCall], ...] = (
    # Ascend's RainFusionAttention; forward only as far as this project verified (no NPU here).
    Plugin(
        SparseKernel.NPU.value,
        npu_block_sparse_attention,
        SparseConstraints(("npu",), _FLOATS, differentiable=False),
        installed=_npu_installed,
        priority=10,
    ),
    # Fused C++ flash loop: forward only; computes other dtypes in fp32. Without a toolchain it
    # falls back to block gather itself (logged), so it counts as installed.
    Plugin(
        SparseKernel.CPU.value,
        fused_cpu_block_sparse_attention,
        SparseConstraints(("cpu",), _FLOATS, differentiable=False),
        priority=20,
    ),
    Plugin(
        SparseKernel.FLEX.value,
        flex_block_sparse_attention,
        SparseConstraints(("cpu", "cuda"), _TRITON_FLOATS, auto_devices=("cuda",)),
        priority=30,
    ),
    # Plain torch (index_select + SDPA): any device, differentiable; the fallback everywhere.
    Plugin(
        SparseKernel.GATHER.value,
        gather_block_sparse_attention,
        SparseConstraints(None, _FLOATS),
        priority=40,
    ),
    Plugin(
        SparseKernel.REFERENCE.value,
        reference_block_sparse_attention,
        SparseConstraints(None, _FLOATS, auto_devices=()),
        priority=90,
    ),
)
for _plugin in _PLUGINS:
    SPARSE_KERNELS.register(_plugin)


def select_kernel(
    call: SparseCall, forced: SparseKernel | str | None = None
) -> Plugin[SparseKernelFn, SparseCall]:
    """The kernel for ``call``: ``forced`` (or an error naming why not), else the chain's first.

    Raises:
        npu_core.plugins.PluginError: an unknown name, or a forced kernel that refuses the call.
    """
    name = (
        None if forced is None else str(forced.value if isinstance(forced, enum.Enum) else forced)
    )
    return SPARSE_KERNELS.select(call, name)
