"""Multi-rank inference: Ulysses sequence parallelism and VAE temporal data parallelism."""

from liteboost.parallel.manager import ParallelConfig, ParallelManager
from liteboost.parallel.ulysses import UlyssesExchange, working_degrees
from liteboost.parallel.vae_dp import (
    decoder_receptive_field,
    encoder_receptive_field,
    parallel_decode,
    parallel_encode,
    plan_spans,
)

__all__ = [
    "ParallelConfig",
    "ParallelManager",
    "UlyssesExchange",
    "decoder_receptive_field",
    "encoder_receptive_field",
    "parallel_decode",
    "parallel_encode",
    "plan_spans",
    "working_degrees",
]
