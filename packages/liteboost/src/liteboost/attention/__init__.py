"""Dense attention backend chain and the diffusers attention processor that uses liteboost ops."""

from liteboost.attention.backends import AttentionBackend, flash_attention, resolve_backend

__all__ = ["AttentionBackend", "flash_attention", "resolve_backend"]
