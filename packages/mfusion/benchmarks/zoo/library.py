"""Tiny configurations of real architectures, built from transformers' and diffusers' own
modeling code with random weights (nothing is downloaded).

Each entry builds ``(module, inputs)``; the module returns one tensor for inference and, through
:class:`TrainStep`, a scalar loss for a training step. Sizes are small enough that a full
benchmark fits on two shared CPU cores, but shaped like the real models: hidden 256, two layers,
batch 2 x 128 tokens (images 64x64, 16x16 latents, 200 mel frames).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

BATCH, SEQ, VOCAB, HIDDEN, LAYERS, HEADS = 2, 128, 1000, 256, 2, 4


def _ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq))


class Pick(nn.Module):
    """Calls a library model and returns the one tensor the benchmark compares."""

    def __init__(self, model: nn.Module, field: str, keywords: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.field, self.keywords = model, field, keywords

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.keywords, inputs, strict=True)))
        return out if isinstance(out, torch.Tensor) else getattr(out, self.field)


class TrainStep(nn.Module):
    """Forward plus loss: the library's own loss where the model has one (causal LMs), else the
    mean square of the output (a stand-in whose backward reaches every weight)."""

    def __init__(self, model: nn.Module, own_loss: bool) -> None:
        super().__init__()
        self.model, self.own_loss = model, own_loss

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.own_loss:
            return self.model(*inputs)
        return self.model(*inputs).float().square().mean()


@dataclasses.dataclass(frozen=True)
class Spec:
    build: Callable[[bool], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    """``build(train)``: the module and its inputs (fp32; the harness casts)."""
    kind: str
    """``transformer`` or ``conv``: how the README groups the rows."""


def _bert(train: bool):
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=SEQ,
    )
    return Pick(BertModel(config), "last_hidden_state", ("input_ids",)), (_ids(),)


def _vit(train: bool):
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        image_size=64,
        patch_size=8,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN,
    )
    model = Pick(ViTModel(config, add_pooling_layer=False), "last_hidden_state", ("pixel_values",))
    return model, (torch.randn(BATCH, 3, 64, 64),)


def _whisper(train: bool):
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=80,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=4 * HIDDEN,
        decoder_ffn_dim=4 * HIDDEN,
        max_source_positions=100,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = Pick(WhisperModel(config), "last_hidden_state", ("input_features", "decoder_input_ids"))
    return model, (torch.randn(BATCH, 80, 200), _ids(32))


def _clip(train: bool):
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": 4 * HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "max_position_embeddings": 64,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        vision_config={
            "hidden_size": HIDDEN,
            "intermediate_size": 4 * HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "image_size": 64,
            "patch_size": 8,
        },
        projection_dim=128,
    )
    model = Pick(CLIPModel(config), "logits_per_image", ("input_ids", "pixel_values"))
    return model, (_ids(64), torch.randn(BATCH, 3, 64, 64))


def _resnet18(train: bool):
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        num_labels=100,
    )
    model = Pick(ResNetForImageClassification(config), "logits", ("pixel_values",))
    return model, (torch.randn(BATCH, 3, 64, 64),)


def _decoder(config_cls: str, model_cls: str, seq: int = SEQ, **extra: object):
    def build(train: bool):
        import transformers

        config = getattr(transformers, config_cls)(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=688,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=seq,
            **extra,
        )
        model = getattr(transformers, model_cls)(config)
        ids = _ids(seq)
        if train:  # the library's own shifted cross-entropy over the vocabulary
            return Pick(model, "loss", ("input_ids", "labels")), (ids, ids.clone())
        return Pick(model, "logits", ("input_ids",)), (ids,)

    return build


def _dit(train: bool):
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(
        num_attention_heads=HEADS,
        attention_head_dim=HIDDEN // HEADS,
        in_channels=4,
        num_layers=LAYERS,
        sample_size=16,
        patch_size=2,
        num_embeds_ada_norm=1000,
    )
    # Training mode drops class labels at random (classifier-free guidance), which no two runs
    # (eager reference, compiled variants) would share: switch the label dropout off.
    from diffusers.models.embeddings import LabelEmbedding

    for module in model.modules():
        if isinstance(module, LabelEmbedding):
            module.dropout_prob = 0.0
    model = Pick(model, "sample", ("hidden_states", "timestep", "class_labels"))
    return model, (
        torch.randn(BATCH, 4, 16, 16),
        torch.randint(0, 1000, (BATCH,)),
        torch.randint(0, 1000, (BATCH,)),
    )


def _dcgan(train: bool):
    # No library ships a DCGAN generator (diffusers' VAEs are not one): the look-alike stays.
    from zoo.vision import DCGANGenerator

    return DCGANGenerator(), (torch.randn(BATCH, 64, 1, 1),)


MODELS: dict[str, Spec] = {
    "bert": Spec(_bert, "transformer"),
    "vit": Spec(_vit, "transformer"),
    "whisper": Spec(_whisper, "transformer"),
    "clip": Spec(_clip, "transformer"),
    "llama": Spec(_decoder("LlamaConfig", "LlamaForCausalLM"), "transformer"),
    "qwen3": Spec(_decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=64), "transformer"),
    "mistral": Spec(
        _decoder("MistralConfig", "MistralForCausalLM", sliding_window=None), "transformer"
    ),
    # The library's eager attention (attn_implementation="eager": models without SDPA support,
    # output_attentions=True), at 512 tokens: the form Inductor's own SDPA patterns miss.
    "llama_eager": Spec(
        _decoder("LlamaConfig", "LlamaForCausalLM", seq=512, attn_implementation="eager"),
        "transformer",
    ),
    "dit": Spec(_dit, "transformer"),
    "resnet18": Spec(_resnet18, "conv"),
    "dcgan": Spec(_dcgan, "conv"),
}


def integer_input(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point
