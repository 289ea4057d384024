"""Per-forward facts the attention processors need but diffusers does not pass them.

A processor sees only (q, k, v)-producing inputs; the latent grid (for sparse tiling and RoPE)
and the sequence shard (for Ulysses) are known at the transformer's entry. A pre-forward hook on
the transformer writes them here; every processor of that transformer reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from liteboost.ops.tiling import TileLayout


@dataclass
class ForwardContext:
    """Shared, mutable state of one transformer: set at each forward's start.

    Attributes:
        grid: post-patch token grid (frames, height, width) of the current forward.
        seq_len: video tokens, ``frames * height * width``.
        shard_len: tokens per rank under Ulysses (padded); equals ``seq_len`` without it.
        token_order: under sequence parallelism, the tile layout the ranks' tokens are cut in
            (block-sparse ring attention), None for raster order.
        local: this forward's per-rank shards of per-token inputs (RoPE rows, per-token
            modulation), cut once and reused by every block; keyed by name, each entry holds
            the source tensor it was cut from.
    """

    grid: tuple[int, int, int] | None = None
    seq_len: int = 0
    shard_len: int = 0
    extra: dict = field(default_factory=dict)
    token_order: TileLayout | None = None
    local: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def set_grid(self, grid: tuple[int, int, int], world: int = 1, align: int = 1) -> None:
        """Start a forward over ``grid``: ``world`` equal shards, each a multiple of ``align``."""
        self.grid = grid
        self.seq_len = grid[0] * grid[1] * grid[2]
        self.shard_len = -(-self.seq_len // (world * align)) * align
        self.token_order = None
        self.local.clear()
