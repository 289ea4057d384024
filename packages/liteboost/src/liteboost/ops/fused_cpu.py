"""The fused CPU block-sparse kernel (``csrc/block_sparse_attention.cpp``), built once per machine.

``torch.utils.cpp_extension`` compiles it on first use (about 50 s on two cores) into torch's
extension cache and loads it from there afterwards. The compiler flags follow the vector ISA
torch dispatches to (:func:`build_config`: AVX-512, AVX2, aarch64, portable) and the cache key
covers flags, source and torch version (:func:`build_name`). It is forward-only fp32: other
dtypes are computed in fp32, and when autograd records, or where no C++ toolchain is available
(logged once), the block-gather kernel runs instead. Key blocks that every query row keeps are
left to one dense SDPA call over all queries and merged through the kernel's log-sum-exp, as in
``block_gather``. The same extension holds the eager CPU RoPE loop (``rope_rotate``, used by
:func:`liteboost.ops.rope.apply_rope`), so one build per machine serves both.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from liteboost import env
from liteboost.ops.block_gather import (
    block_sparse_attention_with_lse,
    gather_block_sparse_attention,
    merge_shared_blocks_with_lse,
    shared_blocks,
    without_blocks,
)
from liteboost.ops.blocks import BlockSize, block_shape, check_same_heads

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "block_sparse_attention.cpp"
# -ffast-math lets the compiler vectorise expf through glibc's libmvec; the kernel avoids
# infinities.
_CFLAGS = ("-O3", "-ffast-math", "-fopenmp")

# x86 vector ISAs, as torch's dispatcher names them, and the compiler flags for exactly the
# features that dispatch level requires (ATen checks the same cpuinfo bits before choosing it).
_X86_ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}
_X86 = ("x86_64", "amd64", "i686", "i386")
_ARM64 = ("aarch64", "arm64")


@dataclass(frozen=True)
class BuildConfig:
    """How the kernel is compiled for one machine: a readable tag and the compiler flags."""

    tag: str
    cflags: tuple[str, ...]


def build_config(capability: str, machine: str) -> BuildConfig:
    """Compiler flags that follow the vector ISA torch itself runs at on this machine.

    Args:
        capability: ``torch.backends.cpu.get_cpu_capability()`` ("AVX512", "AVX2", "DEFAULT",
            "SVE256", ...). Following torch rather than the CPU means an ISA cap
            (``ATEN_CPU_CAPABILITY=avx2``) caps this kernel too, and a CPU torch does not
            trust with a level never gets code for it.
        machine: ``platform.machine()``.

    Returns:
        x86: AVX-512 (F/BW/VL/DQ + FMA) when torch dispatches AVX512, AVX2 + FMA when it
        dispatches AVX2, the x86-64 baseline otherwise. aarch64: no ISA flags (NEON is part of
        the baseline, and the compiler vectorises expf with it). Anything else: portable
        flags only. The vectorised exp matters: the x86-64 baseline build measured 1.3-1.6x
        slower than AVX2.
    """
    arch = machine.lower()
    if arch in _X86:
        level = capability.upper()
        if level in _X86_ISA_FLAGS:
            return BuildConfig(f"x86_{level.lower()}", _CFLAGS + _X86_ISA_FLAGS[level])
        return BuildConfig("x86_baseline", _CFLAGS)
    if arch in _ARM64:
        return BuildConfig("aarch64", _CFLAGS)
    safe = "".join(c if c.isalnum() else "_" for c in arch) or "unknown"
    return BuildConfig(f"{safe}_portable", _CFLAGS)


def build_name(config: BuildConfig, source: str, torch_version: str) -> str:
    """Extension name: the build cache key, so it covers everything that changes the binary.

    The tag and a digest of the flags, the kernel source and the torch version (its headers and
    ABI). Machines sharing a cache directory, or a liteboost upgrade, never load a binary built
    for something else, and never rebuild each other's in turn.
    """
    digest = hashlib.sha256("\0".join((*config.cflags, source, torch_version)).encode())
    return f"liteboost_block_sparse_{config.tag}_{digest.hexdigest()[:12]}"


@functools.cache
def load_cpu_kernel() -> ModuleType | None:
    """The compiled extension, or None (reason logged) where it cannot be built or loaded."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:
        # torch runs the ``ninja`` on PATH; the ninja wheel's own is found when the venv is
        # not activated.
        import ninja

        env.prepend_path(ninja.BIN_DIR)
    config = build_config(torch.backends.cpu.get_cpu_capability(), platform.machine())
    name = build_name(config, _SOURCE.read_text(), torch.__version__)
    logger.info(
        "loading the CPU block-sparse kernel %s (its first build takes about a minute)", name
    )
    try:
        return load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=list(config.cflags),
            extra_ldflags=["-lm"],
        )
    except Exception as exc:  # any toolchain or loader failure means: use the fallback
        logger.warning("CPU block-sparse kernel unavailable, using block gather instead: %s", exc)
        return None


def fused_cpu_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-sparse flash attention on CPU; [B, N, S, D] in and out, dtype of ``q``.

    Args:
        q, k, v: BNSD CPU tensors with the same batch and head counts.
        block_index: int [B, N, ceil(Sq / query block), K] key-block ids, -1 padded anywhere;
            a row lists a block at most once.
        block_size: tokens per block, an int or a (query, key) pair; the last block of either
            may be partial.
        scale: softmax scale; default ``D ** -0.5``.

    Returns:
        [B, N, Sq, Dv]. Query blocks that keep no key block get zeros.
    """
    _check_cpu(q, k, v)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    kernel = None if needs_grad else load_cpu_kernel()
    if kernel is None:
        return gather_block_sparse_attention(q, k, v, block_index, block_size, scale)
    out, _ = _run_kernel(kernel, q, k, v, block_index, block_size, scale)
    return out.to(q.dtype)


def fused_cpu_block_sparse_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_cpu_block_sparse_attention` plus each query row's log-sum-exp.

    For callers that merge partial attentions (ring attention over K/V chunks), as
    :func:`liteboost.ops.block_gather.block_sparse_attention_with_lse`, whose contract this
    keeps: out [B, N, Sq, Dv] in ``q``'s dtype, lse [B, N, Sq] fp32, very negative (the kernel
    writes the lowest float) on rows that keep no key block here, whose output rows are zeros.
    Inference only; where the kernel cannot be built, or autograd records, the block-gather
    version runs.
    """
    _check_cpu(q, k, v)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    kernel = None if needs_grad else load_cpu_kernel()
    if kernel is None:
        return block_sparse_attention_with_lse(q, k, v, block_index, block_size, scale)
    out, lse = _run_kernel(kernel, q, k, v, block_index, block_size, scale)
    return out.to(q.dtype), lse


def _check_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_same_heads(q, k, v)
    if q.device.type != "cpu":
        raise ValueError(f"the 'cpu' sparse kernel needs CPU tensors; got device {q.device}")


def _run_kernel(
    kernel: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [B, N, Sq, Dv], lse fp32 [B, N, Sq]) of the fused kernel.

    Key blocks that every query row keeps run once for all queries at dense SDPA's rate and
    are merged through the kernel's log-sum-exp.
    """
    q_block, kv_block = block_shape(block_size)
    b, n, sq, d = q.shape
    qf, kf, vf = (t.float() for t in (q, k, v))
    shared = shared_blocks(block_index, math.ceil(k.shape[2] / kv_block))
    has_shared = bool(shared.any())
    if has_shared:
        block_index = without_blocks(block_index, shared)
    rows = [t.reshape(b * n, t.shape[2], t.shape[3]) for t in (qf, kf, vf)]
    index = block_index.reshape(b * n, block_index.shape[2], block_index.shape[3]).long()
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out, lse = kernel.block_sparse_attention(*rows, index, q_block, kv_block, scale)
    out, lse = out.view(b, n, sq, v.shape[-1]), lse.view(b, n, sq)
    if has_shared:
        out, lse = merge_shared_blocks_with_lse(qf, kf, vf, out, lse, shared, kv_block, scale)
    return out, lse
