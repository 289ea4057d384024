"""Kernels: block-sparse attention (low- and high-level), cached Wan RoPE."""

from liteboost.ops.rain_fusion import SparseKernel, rain_fusion_attention
from liteboost.ops.rope import RopeTables, apply_rope, clear_rope_cache, rope_tables
from liteboost.ops.sparse_attention import SparsePlan, plan_sparse_attention, sparse_attention
from liteboost.ops.tiling import TileLayout, tile_layout

__all__ = [
    "RopeTables",
    "SparseKernel",
    "SparsePlan",
    "TileLayout",
    "apply_rope",
    "clear_rope_cache",
    "plan_sparse_attention",
    "rain_fusion_attention",
    "rope_tables",
    "sparse_attention",
    "tile_layout",
]
