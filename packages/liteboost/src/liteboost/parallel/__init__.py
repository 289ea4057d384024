"""Multi-rank inference: Ulysses sequence parallelism and VAE temporal data parallelism."""

from liteboost.parallel.manager import ParallelConfig, ParallelManager
from liteboost.parallel.ulysses import UlyssesExchange, working_degrees
from liteboost.parallel.vae_dp import (
    decode_span,
    decoder_receptive_field,
    encode_span,
    encoder_receptive_field,
    finish_encode,
    parallel_decode,
    parallel_encode,
    plan_spans,
)

__all__ = [
    "ParallelConfig",
    "ParallelManager",
    "UlyssesExchange",
    "decode_span",
    "decoder_receptive_field",
    "encode_span",
    "encoder_receptive_field",
    "finish_encode",
    "parallel_decode",
    "parallel_encode",
    "plan_spans",
    "working_degrees",
]
