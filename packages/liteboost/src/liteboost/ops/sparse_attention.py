"""Block-sparse attention for video tokens: tile, pool, score, keep top-k, attend, untile.

Sequence layout: ``latent_shape`` video tokens (raster order, frame-major, as diffusers flattens
them) followed by ``text_len`` text tokens (joint-attention models; Wan's self-attention has
none). Text query blocks attend everything, text key blocks and first-frame key blocks are
always kept, and the remaining budget goes to the key blocks whose pooled key scores highest
against the pooled query, per batch element and head (the two halves of a CFG batch differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from liteboost.attention.backends import flash_attention
from liteboost.ops import tiling
from liteboost.ops.blocks import BlockSize, block_shape, check_latent_shape, check_qkv
from liteboost.ops.rain_fusion import (
    SparseKernel,
    check_layout,
    from_bnsd,
    rain_fusion_attention,
    to_bnsd,
)


@dataclass(frozen=True)
class SparsePlan:
    """What :func:`plan_sparse_attention` decided for one call, reusable across layers.

    Attributes:
        layout: the video token permutation.
        block_index: int32 [B, N, nq, K] kept key blocks per query block, -1 padded.
        keep: key blocks kept per video query row (forced blocks included).
    """

    layout: tiling.TileLayout
    block_index: torch.Tensor
    keep: int


def _check_sparsity(sparsity: float) -> None:
    # isinstance with a tuple, not ``int | float``: torch 2.9's Dynamo (our floor) cannot wrap a
    # types.UnionType and breaks the graph (these checks run inside traced attention).
    if (
        isinstance(sparsity, bool)
        or not isinstance(sparsity, (int, float))
        or not (0.0 <= sparsity < 1.0)
    ):
        raise ValueError(
            f"sparsity={sparsity!r} must be a number in [0, 1): the share of key blocks skipped"
        )


def _check_scale(scale: float | None) -> None:
    if scale is not None and not (isinstance(scale, (int, float)) and 0.0 < scale < math.inf):
        raise ValueError(f"scale={scale!r}; expected None (D ** -0.5) or a finite number > 0")


def block_sums(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sum over consecutive blocks of ``x`` [B, N, S, D] -> [B, N, ceil(S / bs), D] (fp32).

    A block's sum does not depend on what else is in ``x``: ring ranks sum their own blocks and
    get the single process's bits.
    """
    b, n, s, d = x.shape
    blocks = math.ceil(s / block_size)
    pad = blocks * block_size - s
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    return xf.view(b, n, blocks, block_size, d).sum(-2)


def block_means(sums: torch.Tensor, tokens: int, block_size: int) -> torch.Tensor:
    """Block sums [B, N, ceil(tokens / bs), D] of a ``tokens``-long sequence -> block means."""
    blocks = sums.shape[-2]
    counts = torch.full((blocks,), float(block_size), device=sums.device)
    counts[-1] = tokens - (blocks - 1) * block_size
    return sums / counts.view(1, 1, -1, 1)


def _pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean over consecutive blocks of ``x`` [B, N, S, D] -> [B, N, ceil(S / bs), D] (fp32)."""
    return block_means(block_sums(x, block_size), x.shape[-2], block_size)


def select_blocks(
    q_tiled: torch.Tensor,
    k_tiled: torch.Tensor,
    *,
    video_len: int,
    first_frame_tokens: int,
    sparsity: float,
    block_size: tuple[int, int],
) -> tuple[torch.Tensor, int]:
    """Top-k key blocks per query block from pooled scores; [B, N, S, D] tiled inputs.

    Args:
        block_size: (query block, key block) tokens.

    Returns:
        (block_index int32 [B, N, nq, K] padded with -1, keep per video query block).
    """
    q_block, kv_block = block_size
    return select_pooled_blocks(
        _pool_blocks(q_tiled, q_block),
        _pool_blocks(k_tiled, kv_block),
        key_tokens=k_tiled.shape[-2],
        video_len=video_len,
        first_frame_tokens=first_frame_tokens,
        sparsity=sparsity,
        block_size=block_size,
    )


def select_pooled_blocks(
    pooled_q: torch.Tensor,
    pooled_k: torch.Tensor,
    *,
    key_tokens: int,
    video_len: int,
    first_frame_tokens: int,
    sparsity: float,
    block_size: tuple[int, int],
) -> tuple[torch.Tensor, int]:
    """:func:`select_blocks` from block means [B, N, nq, D] and [B, N, nk, D] of tiled q, k.

    Ring attention calls it with means gathered from every rank (``key_tokens`` real keys).
    """
    q_block, kv_block = block_size
    nq, nk = pooled_q.shape[-2], pooled_k.shape[-2]
    scores = pooled_q @ pooled_k.transpose(-1, -2)
    forced = torch.zeros(nk, dtype=torch.bool, device=scores.device)
    has_text = key_tokens > video_len
    # Forced blocks: frame 0's head and the blocks holding any text token; counted in Python
    # (no ``.item()``), so the plan traces into a torch.compile graph without a break.
    text_start = video_len // kv_block if has_text else nk
    frame0_end = min(math.ceil(first_frame_tokens / kv_block), nk) if first_frame_tokens else 0
    if has_text:
        forced[text_start:] = True
    if frame0_end:
        forced[:frame0_end] = True
    forced_count = frame0_end + max(0, nk - max(text_start, frame0_end))
    keep = min(nk, max(forced_count, math.ceil((1.0 - sparsity) * nk), 1))
    scores = scores.masked_fill(forced, torch.inf)
    index = scores.topk(keep, dim=-1, sorted=False).indices.to(torch.int32)
    text_rows = torch.arange(nq, device=scores.device) >= video_len // q_block
    if keep < nk and has_text:
        # Text query rows (and the boundary block) attend every key block.
        full = torch.arange(nk, device=scores.device, dtype=torch.int32)
        padded = torch.cat([index, index.new_full((*index.shape[:-1], nk - keep), -1)], dim=-1)
        index = torch.where(text_rows.view(-1, 1), full, padded)
    return index, keep


def _tile_layout(
    q: torch.Tensor,
    latent_shape: tuple[int, int, int],
    block_size: tuple[int, int],
    tile: tuple[int, int, int] | None,
    first_frame_sink: bool,
) -> tiling.TileLayout:
    """The tile permutation for checked BNSD inputs.

    Default tiles hold one key block, so every key block is a compact 3-D neighbourhood; a
    larger query block spans neighbouring tiles.
    """
    return tiling.tile_layout(
        latent_shape, tile or tiling.default_tile(block_size[1]), q.device, first_frame_sink
    )


def _select_tiled(
    qt: torch.Tensor,
    kt: torch.Tensor,
    layout: tiling.TileLayout,
    latent_shape: tuple[int, int, int],
    sparsity: float,
    block_size: tuple[int, int],
) -> SparsePlan:
    index, keep = select_blocks(
        qt,
        kt,
        video_len=math.prod(latent_shape),
        first_frame_tokens=layout.first_frame_tokens,
        sparsity=sparsity,
        block_size=block_size,
    )
    return SparsePlan(layout, index, keep)


def plan_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    latent_shape: tuple[int, int, int],
    text_len: int = 0,
    sparsity: float,
    block_size: BlockSize = 128,
    tile: tuple[int, int, int] | None = None,
    first_frame_sink: bool = True,
) -> SparsePlan:
    """Tile layout and kept blocks for [B, N, S, D] ``q``/``k`` (untiled, BNSD)."""
    _check_sparsity(sparsity)
    block_size = block_shape(block_size)
    check_qkv(q, k, k, "BNSD")
    latent_shape = check_latent_shape(latent_shape, text_len, q.shape[-2], tuple(q.shape))
    layout = _tile_layout(q, latent_shape, block_size, tile, first_frame_sink)
    qt, kt = (tiling.reorder(t, layout, seq_dim=2) for t in (q, k))
    return _select_tiled(qt, kt, layout, latent_shape, sparsity, block_size)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    latent_shape: tuple[int, int, int],
    text_len: int = 0,
    sparsity: float,
    block_size: BlockSize = 128,
    layout: str = "BNSD",
    first_frame_sink: bool = True,
    tile: tuple[int, int, int] | None = None,
    scale: float | None = None,
    kernel: SparseKernel | str | None = None,
) -> torch.Tensor:
    """Block-sparse self-attention over video (+ text) tokens; dense attention at sparsity 0.

    Args:
        q: [B, N, S, D] ("BNSD") or [B, S, N, D] ("BSND"), S = prod(latent_shape) + text_len.
        k: like ``q``.
        v: like ``q``.
        latent_shape: token grid (frames, height, width) after patching, e.g. (21, 30, 52) for
            Wan 480p 81 frames.
        text_len: text tokens after the video tokens (0 for Wan self-attention).
        sparsity: share of key blocks skipped per query block, in [0, 1). 0, and any sparsity
            that keeps every key block, runs dense attention through
            :func:`liteboost.attention.flash_attention` (identical output; the reordered path
            with every block kept measured slower, ``benchmarks/sparsity_zero.py``) unless a
            ``kernel`` is forced.
        block_size: tokens per block: an int for queries and keys alike, or a (query, key)
            pair. Keys are selected per key block, each query block choosing for all its
            queries.
        layout: "BNSD" or "BSND", for inputs and output alike.
        first_frame_sink: tile frame 0 on its own and always keep its key blocks.
        tile: (frames, rows, cols) per tile; default about one key block (2 x 8 x 8 for 128).
        scale: softmax scale; default ``D ** -0.5``.
        kernel: forwarded to :func:`rain_fusion_attention`.

    Returns:
        Output in ``layout``, token order of the input.

    Raises:
        TypeError: q, k or v is not a tensor.
        ValueError: the same checks at every sparsity, before any work: layout, sparsity,
            scale, block size, q/k/v dims, dtype (floating), device, batch, heads, tokens and
            head dims, and ``latent_shape`` + ``text_len`` against q's token count. Each
            message names the argument, its shape or value and what is expected.
    """
    check_layout(layout)
    _check_sparsity(sparsity)
    _check_scale(scale)
    block_size = block_shape(block_size)
    check_qkv(q, k, v, layout)
    tokens = q.shape[2] if layout == "BNSD" else q.shape[1]
    latent_shape = check_latent_shape(latent_shape, text_len, tokens, tuple(q.shape))
    if sparsity == 0.0:
        return flash_attention(q, k, v, layout=layout, scale=scale)
    qb, kb, vb = (to_bnsd(t, layout) for t in (q, k, v))
    tiles = _tile_layout(qb, latent_shape, block_size, tile, first_frame_sink)
    qt, kt, vt = (tiling.reorder(t, tiles, seq_dim=2) for t in (qb, kb, vb))
    plan = _select_tiled(qt, kt, tiles, latent_shape, sparsity, block_size)
    if kernel is None and plan.keep >= math.ceil(kt.shape[-2] / block_size[1]):
        # Every row keeps every key block (a low sparsity on few blocks): that is dense
        # attention, and the dense chain measured faster than the reordered path with all blocks
        # kept (0.64-0.94x dense on CPU; benchmarks/sparsity_zero.py).
        return flash_attention(q, k, v, layout=layout, scale=scale)
    out = rain_fusion_attention(
        qt, kt, vt, plan.block_index, block_size=block_size, scale=scale, kernel=kernel
    )
    return from_bnsd(tiling.restore(out, tiles, seq_dim=2), layout)
