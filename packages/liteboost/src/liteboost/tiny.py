"""A tiny random-weight Wan (transformer, VAE, UMT5 text encoder, byte tokenizer), built offline.

Used by the tests, the benchmarks and ``liteboost generate`` when no ``--model`` is given: it
exercises every code path of the real model (3-D RoPE, causal VAE, CFG) in seconds on a CPU and
needs no download. Its output is noise-like by construction (random weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported lazily at run time: importing liteboost must stay cheap
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline

# Keyword arguments for the diffusers / transformers config constructors (mixed value types).
TINY_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
)
TINY_VAE: dict[str, Any] = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.0] * 4,
    latents_std=[1.0] * 4,
)
TINY_TEXT_ENCODER: dict[str, Any] = dict(
    vocab_size=384,
    d_model=16,
    d_kv=4,
    d_ff=32,
    num_layers=1,
    num_heads=4,
    relative_attention_num_buckets=8,
)


def build_tiny_transformer(seed: int = 0, **overrides: Any) -> WanTransformer3DModel:
    """WanTransformer3DModel with the tiny config (``overrides`` change single fields)."""
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**{**TINY_TRANSFORMER, **overrides}).eval()


def build_tiny_vae(seed: int = 0) -> AutoencoderKLWan:
    """AutoencoderKLWan with the tiny config: 8x spatial, 4x temporal compression."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**TINY_VAE).eval()


def build_tiny_pipeline(seed: int = 0) -> WanPipeline:
    """WanPipeline from tiny components: nothing is downloaded."""
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline
    from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(**TINY_TEXT_ENCODER)).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return WanPipeline(
        # diffusers annotates `tokenizer` as the AutoTokenizer factory class, which no tokenizer
        # instance is; the pipeline only calls the tokenizer.
        tokenizer=ByT5Tokenizer(),  # type: ignore[arg-type]
        text_encoder=text_encoder,
        vae=build_tiny_vae(seed),
        scheduler=scheduler,
        transformer=build_tiny_transformer(seed),
    )
