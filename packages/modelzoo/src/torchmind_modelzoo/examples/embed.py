"""Encoder examples: pooled text embeddings, cross-encoder scores, image-text similarity."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from torchmind_modelzoo.examples.base import Example, model_config, model_dtype, seeded_ids


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Pool token states into one vector per sequence.

    Args:
        hidden: [B, S, D] last hidden states.
        mask: [B, S] 1 for real tokens, 0 for padding (right padding).
        how: ``last`` (last real token, Qwen3-Embedding), ``mean`` or ``cls`` (first token).
    """
    if how == "cls":
        return hidden[:, 0]
    if how == "mean":
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
    last = mask.sum(1) - 1
    return hidden[torch.arange(hidden.shape[0]), last]


def _two_sequences(model: torch.nn.Module, seq: int) -> dict[str, torch.Tensor]:
    """Two seeded sequences of ``seq`` tokens, the second one right-padded from ``seq // 2``."""
    vocab = int(model_config(model).get_text_config().vocab_size)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq // 2 :] = 0
    return {"input_ids": seeded_ids(vocab, (2, seq)), "attention_mask": mask}


class Embedding(Example):
    """Embed a batch of two sequences (the second one padded) and compare them."""

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return _two_sequences(model, self.cfg.seq_len)

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        hidden = model(**inputs).last_hidden_state
        return F.normalize(pool(hidden, inputs["attention_mask"], self.cfg.pooling).float(), dim=-1)

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, **_: Any) -> dict[str, Any]:
        emb = self.forward(model, **self.inputs(model))
        return {
            "embedding_dim": int(emb.shape[-1]),
            "norms": [round(float(n), 6) for n in emb.norm(dim=-1)],
            "cosine": round(float(emb[0] @ emb[1]), 6),
        }


class CrossEncoder(Example):
    """Score two (query, document) pairs with a sequence-classification head."""

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return _two_sequences(model, self.cfg.seq_len)

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs).logits[:, 0].float()

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, **_: Any) -> dict[str, Any]:
        scores = self.forward(model, **self.inputs(model))
        return {"pairs": int(scores.numel()), "scores": [round(float(s), 6) for s in scores]}


class ImageText(Example):
    """CLIP/SigLIP: logits between two random images and two token sequences."""

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        config = model_config(model)
        vision = config.vision_config
        gen = torch.Generator().manual_seed(0)
        pixels = torch.randn(
            2, vision.num_channels, vision.image_size, vision.image_size, generator=gen
        )
        text = config.text_config
        ids = seeded_ids(text.vocab_size, (2, self.cfg.seq_len))
        return {"input_ids": ids, "pixel_values": pixels.to(model_dtype(model))}

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs).logits_per_image.float()

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, **_: Any) -> dict[str, Any]:
        logits = self.forward(model, **self.inputs(model))
        return {
            "logits_per_image": [[round(float(x), 6) for x in row] for row in logits],
            "best_text_per_image": logits.argmax(-1).tolist(),
        }
