"""The FlexAttention block-sparse kernel: a ``BlockMask`` built from the kept-block list.

Compiled once per shape and cached (8-35 s on CPU); on CUDA it is a fused Triton kernel and the
chain's choice there. On CPU the fused and gather kernels measured faster, so there it runs only
when forced (``kernel="flex"``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from liteboost.ops.blocks import BlockSize, block_shape

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask, FlexKernelOptions

logger = logging.getLogger(__name__)


# One compiled FlexAttention per (shape, dtype, device, block size): compiling costs 8-35 s on
# CPU, so a process pays it once per shape. torch.compile's own guard cache would also work, but
# an explicit table keeps several shapes from exhausting dynamo's per-function recompile limit.
_FLEX_CACHE: dict[tuple, Callable[..., torch.Tensor]] = {}
_FLEX_LOCK = threading.Lock()


def _compiled_flex(key: tuple) -> Callable[..., torch.Tensor]:
    with _FLEX_LOCK:
        fn = _FLEX_CACHE.get(key)
        if fn is None:
            from torch.nn.attention.flex_attention import flex_attention

            fn = torch.compile(flex_attention, dynamic=False)
            _FLEX_CACHE[key] = fn
            logger.debug("compiling FlexAttention for %s", key)
        return fn


def build_block_mask(
    block_index: torch.Tensor, block_size: BlockSize, seq_len: tuple[int, int]
) -> BlockMask:
    """FlexAttention ``BlockMask`` from a -1 padded key-block list [B, N, nq, K].

    Every listed block is passed as a *full* block (no per-token mask inside), so the compiled
    kernel skips mask evaluation; only the sequence tail, which FlexAttention bounds by
    ``seq_lengths``, is partial. The mask's ``mask_mod`` still states the same block pattern
    token by token (a lookup in a [B, N, nq, nk] table): FlexAttention's eager math path (what a
    caller's graph runs under a non-Inductor backend) honours only ``mask_mod``, so with the
    default all-true one it would attend every key.
    """
    from torch.nn.attention.flex_attention import BlockMask

    block_size = block_shape(block_size)
    num_kv_blocks = math.ceil(seq_len[1] / block_size[1])
    valid = block_index >= 0
    # Kept-block table; -1 padding lands in an extra column that is cut off.
    table = torch.zeros(
        (*block_index.shape[:-1], num_kv_blocks + 1), dtype=torch.bool, device=block_index.device
    )
    table.scatter_(-1, torch.where(valid, block_index, num_kv_blocks).long(), True)
    table = table[..., :num_kv_blocks]
    q_block, kv_block = block_size

    def kept(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return table[b, h, q_idx // q_block, kv_idx // kv_block]

    counts = valid.sum(-1, dtype=torch.int32)
    width = block_index.shape[-1]
    indices = torch.where(valid, block_index, 0).to(torch.int32)
    if width < num_kv_blocks:
        pad = indices.new_zeros((*indices.shape[:-1], num_kv_blocks - width))
        indices = torch.cat([indices, pad], dim=-1)
    empty = torch.zeros_like(counts)
    return BlockMask.from_kv_blocks(
        empty,
        torch.zeros_like(indices),
        counts,
        indices.contiguous(),
        BLOCK_SIZE=block_size,
        mask_mod=kept,
        seq_lengths=seq_len,
        compute_q_blocks=False,
    )


def flex_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
    block_mask: BlockMask | None = None,
) -> torch.Tensor:
    """FlexAttention kernel; [B, N, S, D] in and out. ``block_mask`` may be prebuilt."""
    block_size = block_shape(block_size)
    if block_mask is None:
        block_mask = build_block_mask(block_index, block_size, (q.shape[-2], k.shape[-2]))
    options = _kernel_options(q.device, block_size)
    if torch.compiler.is_compiling():
        # Inside a caller's torch.compile graph: dynamo captures flex_attention as its own
        # higher-order op, so the kernel joins that graph (the cached compiled wrapper and its
        # lock would break it).
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, kernel_options=options)
    key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device.type, block_size)
    fn = _compiled_flex(key)
    # No score_mod or mask_mod: every kept block is attended whole, so the per-element mask
    # evaluation can be skipped (sequence tails are bounded by the kernel itself).
    return fn(q, k, v, block_mask=block_mask, scale=scale, kernel_options=options)


def _kernel_options(device: torch.device, block_size: tuple[int, int]) -> FlexKernelOptions:
    """FlexAttention kernel options: on CPU skip the mask score; on GPUs, tiles that fit blocks.

    Every kept block is a full block, so no kernel evaluates ``mask_mod`` inside one; the CPU
    template also has ``SKIP_MASK_SCORE`` (a CPU-only option, not passed to Triton). The Triton
    kernel needs its tile (BLOCK_M x BLOCK_N) to divide the mask's blocks, and torch releases
    before the tile shrinking of newer ones keep a default 128-row tile for bf16 / head dim 128,
    so a 64-token query block would be refused: blocks below 128 tokens pin 64 x 64 tiles (or
    the block itself when smaller).
    """
    options: FlexKernelOptions = {}
    if device.type == "cpu":
        # Read by Inductor's CPU template; not among FlexKernelOptions' declared keys.
        options["SKIP_MASK_SCORE"] = True  # type: ignore[typeddict-unknown-key]
        return options
    q_block, kv_block = block_size
    powers_of_two = all(b >= 16 and b & (b - 1) == 0 for b in (q_block, kv_block))
    if min(q_block, kv_block) < 128 and powers_of_two:
        options["BLOCK_M"] = min(64, q_block)
        options["BLOCK_N"] = min(64, kv_block)
    return options
