"""Vision-language example: one image plus text, prefill, then greedy decoding (Qwen3-VL family).

The image arrives as the processor would deliver it: flattened patches ``pixel_values``
[N, C * temporal_patch * patch * patch], its grid ``image_grid_thw`` [1, 3], and one image
placeholder token per merged patch in ``input_ids``, flagged in ``mm_token_type_ids``.
"""

from __future__ import annotations

from typing import Any

import torch

from torchmind_modelzoo.examples.base import Example, model_config, model_dtype, seeded_ids


class VisionLanguage(Example):
    """Describe a random image: greedy tokens after a multimodal prefill."""

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        cfg = model_config(model)
        vision = cfg.vision_config
        merge = vision.spatial_merge_size
        side = 2 * merge  # a 2 x 2 grid of merged tokens: the smallest image with structure
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        gen = torch.Generator().manual_seed(0)
        pixels = torch.randn(side * side, patch_dim, generator=gen).to(model_dtype(model))
        image_tokens = side * side // merge**2
        text = seeded_ids(min(cfg.image_token_id, cfg.text_config.vocab_size), (self.cfg.seq_len,))
        ids = torch.cat(
            [
                text[:2],
                torch.tensor([cfg.vision_start_token_id]),
                torch.full((image_tokens,), cfg.image_token_id),
                torch.tensor([cfg.vision_end_token_id]),
                text[2:],
            ]
        ).unsqueeze(0)
        return {
            "input_ids": ids,
            "pixel_values": pixels,
            "image_grid_thw": torch.tensor([[1, side, side]]),
            "mm_token_type_ids": (ids == cfg.image_token_id).int(),
        }

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs, use_cache=False).logits

    @torch.inference_mode()
    def generate(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], n: int
    ) -> list[int]:
        """Greedy continuation after a multimodal prefill; decoding steps feed one token each."""
        out = model(**inputs, use_cache=True)
        tokens: list[int] = []
        for _ in range(n):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        return tokens

    def run(self, model: torch.nn.Module, **_: Any) -> dict[str, Any]:
        inputs = self.inputs(model)
        return {
            "prompt_tokens": int(inputs["input_ids"].shape[1]),
            "image_tokens": int((inputs["mm_token_type_ids"] == 1).sum()),
            "new_token_ids": self.generate(model, inputs, self.cfg.new_tokens),
        }
