"""Per-forward facts the attention processors need but diffusers does not pass them.

A processor sees only (q, k, v)-producing inputs; the latent grid (for sparse tiling and RoPE)
and the sequence shard (for Ulysses) are known at the transformer's entry. A pre-forward hook on
the transformer writes them here; every processor of that transformer reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ForwardContext:
    """Shared, mutable state of one transformer: set at each forward's start.

    Attributes:
        grid: post-patch token grid (frames, height, width) of the current forward.
        seq_len: video tokens, ``frames * height * width``.
        shard_len: tokens per rank under Ulysses (padded); equals ``seq_len`` without it.
    """

    grid: tuple[int, int, int] | None = None
    seq_len: int = 0
    shard_len: int = 0
    extra: dict = field(default_factory=dict)

    def set_grid(self, grid: tuple[int, int, int], world: int = 1) -> None:
        self.grid = grid
        self.seq_len = grid[0] * grid[1] * grid[2]
        self.shard_len = -(-self.seq_len // world)
