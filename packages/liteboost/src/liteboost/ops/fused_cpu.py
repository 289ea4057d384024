"""The fused CPU block-sparse kernel (``csrc/block_sparse_attention.cpp``), built once per machine.

``torch.utils.cpp_extension`` compiles it on first use (about 50 s on two cores) into torch's
extension cache and loads it from there afterwards. It is forward-only fp32: other dtypes are
computed in fp32, and when autograd records, or where no C++ toolchain is available (logged once),
the block-gather kernel runs instead. Key blocks that every query row keeps are left to one dense
SDPA call over all queries and merged through the kernel's log-sum-exp, as in ``block_gather``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from liteboost.ops.block_gather import (
    gather_block_sparse_attention,
    merge_shared_blocks,
    shared_blocks,
    without_blocks,
)
from liteboost.ops.blocks import BlockSize, block_shape, check_same_heads

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "block_sparse_attention.cpp"
# -ffast-math lets gcc vectorise expf through glibc's libmvec; the kernel avoids infinities.
_CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]


def _isa() -> tuple[str, list[str]]:
    """(build name suffix, compiler flags) for the vector ISA torch itself dispatches to here.

    AVX2 code measured 1.3-1.6x faster than the x86-64 baseline (AVX-512 no faster than AVX2).
    The ISA is part of the build name, so a cache shared by different machines stays correct.
    """
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


@functools.cache
def load_cpu_kernel() -> ModuleType | None:
    """The compiled extension, or None (reason logged) where it cannot be built or loaded."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:
        # torch runs the ``ninja`` on PATH; the ninja wheel's own is found when the venv is
        # not activated.
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    isa, isa_flags = _isa()
    logger.info("loading the CPU block-sparse kernel (its first build takes about a minute)")
    try:
        return load(
            name=f"liteboost_block_sparse_{isa}",
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS + isa_flags,
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
    check_same_heads(q, k, v)
    if q.device.type != "cpu":
        raise ValueError(f"the 'cpu' sparse kernel needs CPU tensors; got device {q.device}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    kernel = None if needs_grad else load_cpu_kernel()
    if kernel is None:
        return gather_block_sparse_attention(q, k, v, block_index, block_size, scale)
    q_block, kv_block = block_shape(block_size)
    b, n, sq, d = q.shape
    qf, kf, vf = (t.float() for t in (q, k, v))
    shared = shared_blocks(block_index, math.ceil(k.shape[2] / kv_block))
    has_shared = bool(shared.any())
    if has_shared:
        # Blocks every row keeps run once for all queries at dense SDPA's rate (merged below).
        block_index = without_blocks(block_index, shared)
    rows = [t.reshape(b * n, t.shape[2], t.shape[3]) for t in (qf, kf, vf)]
    index = block_index.reshape(b * n, block_index.shape[2], block_index.shape[3]).long()
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out, lse = kernel.block_sparse_attention(*rows, index, q_block, kv_block, scale)
    out, lse = out.view(b, n, sq, v.shape[-1]), lse.view(b, n, sq)
    if has_shared:
        out = merge_shared_blocks(qf, kf, vf, out, lse, shared, kv_block, scale)
    return out.to(q.dtype)
