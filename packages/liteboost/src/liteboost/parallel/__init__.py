"""Multi-rank inference: CFG x Ring x Ulysses transformer, spatial or temporal VAE decode."""

from liteboost.parallel.config import ParallelConfig, resolve_degrees
from liteboost.parallel.manager import ParallelManager, ParallelRuntime
from liteboost.parallel.ring import (
    RingAttention,
    attention_with_lse,
    merge_partials,
    tiled_chunk,
)
from liteboost.parallel.ring_kernels import RING_DENSE_KERNELS, RING_SPARSE_KERNELS, ChunkCall
from liteboost.parallel.sequence import SequenceParallel
from liteboost.parallel.ulysses import UlyssesExchange, working_degrees
from liteboost.parallel.vae_dp import (
    choose_decode_mode,
    decode_span,
    decoder_receptive_field,
    encode_span,
    encoder_receptive_field,
    finish_encode,
    parallel_decode,
    parallel_encode,
    plan_spans,
)
from liteboost.parallel.vae_spatial import HaloExchange, plan_rows, spatial_decode, spatial_plan

__all__ = [
    "RING_DENSE_KERNELS",
    "RING_SPARSE_KERNELS",
    "ChunkCall",
    "HaloExchange",
    "ParallelConfig",
    "ParallelManager",
    "ParallelRuntime",
    "RingAttention",
    "SequenceParallel",
    "UlyssesExchange",
    "attention_with_lse",
    "choose_decode_mode",
    "decode_span",
    "decoder_receptive_field",
    "encode_span",
    "encoder_receptive_field",
    "finish_encode",
    "merge_partials",
    "parallel_decode",
    "parallel_encode",
    "plan_rows",
    "plan_spans",
    "resolve_degrees",
    "spatial_decode",
    "spatial_plan",
    "tiled_chunk",
    "working_degrees",
]
