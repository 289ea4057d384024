"""Dense attention backend chain and the diffusers attention processor that uses liteboost ops."""

from liteboost.attention.backends import (
    AttentionBackend,
    AttentionCall,
    Constraints,
    flash_attention,
    forced_backend,
    installed_backends,
    select_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionCall",
    "Constraints",
    "flash_attention",
    "forced_backend",
    "installed_backends",
    "select_backend",
]
