"""liteboost: inference boost for diffusers video models (Wan2.1 / Wan2.2).

Block-sparse self-attention, a dense attention backend chain, cached RoPE, Ulysses sequence
parallelism and VAE temporal parallelism, attached to diffusers models through their processor
and hook extension points. Importing liteboost initialises no device and imports no NPU code.
"""

from importlib.metadata import version

from liteboost.attention.backends import AttentionBackend, flash_attention
from liteboost.boost import BoostConfig, BoostManager
from liteboost.models.registry import (
    UnsupportedModelError,
    register_boost,
    register_parallel,
    supported_boosts,
    supported_parallel,
)
from liteboost.ops import rain_fusion_attention, sparse_attention
from liteboost.parallel.config import ParallelConfig
from liteboost.parallel.manager import ParallelManager

__version__ = version("torchmind-liteboost")

__all__ = [
    "AttentionBackend",
    "BoostConfig",
    "BoostManager",
    "ParallelConfig",
    "ParallelManager",
    "UnsupportedModelError",
    "__version__",
    "flash_attention",
    "rain_fusion_attention",
    "register_boost",
    "register_parallel",
    "sparse_attention",
    "supported_boosts",
    "supported_parallel",
]
