"""Tile reorder: a permutation whose inverse restores raw order, for aligned and ragged grids."""

import pytest
import torch

from liteboost.ops import tiling


@pytest.mark.parametrize(
    "grid",
    [(3, 16, 16), (5, 30, 52), (21, 45, 80)],
    ids=["aligned", "wan480p-remainder", "wan720p-remainder"],
)
def test_reorder_restore_round_trip(grid):
    """reorder then restore returns the input exactly, remainder rows and columns included."""
    layout = tiling.tile_layout(grid, (2, 8, 8))
    n = grid[0] * grid[1] * grid[2]
    x = torch.randn(2, 3, n, 4)
    tiled = tiling.reorder(x, layout, seq_dim=2)
    assert not torch.equal(tiled, x)
    assert torch.equal(tiling.restore(tiled, layout, seq_dim=2), x)
    assert sorted(layout.order.tolist()) == list(range(n))


def test_tiles_are_contiguous_and_first_frame_leads():
    """Tiled order lists frame 0 first, then each (2 x 8 x 8) tile's tokens together."""
    grid = (5, 30, 52)
    layout = tiling.tile_layout(grid, (2, 8, 8))
    order = layout.order
    frame = order // (30 * 52)
    row = (order % (30 * 52)) // 52
    col = order % 52
    assert layout.first_frame_tokens == 30 * 52
    assert torch.all(frame[: 30 * 52] == 0) and torch.all(frame[30 * 52 :] > 0)
    # The first tile after frame 0: frames 1-2, rows 0-7, cols 0-7 -> 128 tokens.
    first_tile = slice(30 * 52, 30 * 52 + 128)
    assert set(frame[first_tile].tolist()) == {1, 2}
    assert row[first_tile].max() < 8 and col[first_tile].max() < 8
    # The last tile of a frame pair is the 6 x 4 remainder corner (rows 24-29, cols 48-51).
    pair_end = 30 * 52 + 2 * 30 * 52
    corner = slice(pair_end - 2 * 6 * 4, pair_end)
    assert row[corner].min() == 24 and col[corner].min() == 48


def test_with_offset_leaves_other_tokens_in_place():
    """Tokens outside [offset, offset + L) (e.g. text) are not moved."""
    layout = tiling.tile_layout((2, 3, 5), (1, 2, 2))
    x = torch.arange(40).view(1, 40, 1).float()
    tiled = tiling.reorder(x, layout, seq_dim=1, offset=5)
    assert torch.equal(tiled[:, :5], x[:, :5]) and torch.equal(tiled[:, 35:], x[:, 35:])
    assert torch.equal(tiling.restore(tiled, layout, seq_dim=1, offset=5), x)


def test_bad_grid_names_the_argument():
    with pytest.raises(ValueError, match="latent_shape"):
        tiling.tile_layout((0, 4, 4), (1, 2, 2))
