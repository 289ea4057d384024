"""Per-model-class plans (Wan) and the registry that finds them."""

from liteboost.models.registry import (
    UnsupportedModelError,
    find_boost,
    find_parallel,
    register_boost,
    register_parallel,
    supported_boosts,
    supported_parallel,
)

__all__ = [
    "UnsupportedModelError",
    "find_boost",
    "find_parallel",
    "register_boost",
    "register_parallel",
    "supported_boosts",
    "supported_parallel",
]
