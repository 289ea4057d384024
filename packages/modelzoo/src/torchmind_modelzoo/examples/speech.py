"""Speech example: transcribe a synthetic waveform with greedy decoding (Whisper family)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from torchmind_modelzoo.examples.base import Example, model_config, model_dtype

SAMPLE_RATE = 16_000


def synthetic_waveform(seconds: float, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """A 1-D float32 chirp (220 -> 880 Hz) with a slow amplitude envelope: speech-like energy
    in every mel band the model sees, reproducible without any audio file."""
    t = torch.arange(int(seconds * sample_rate), dtype=torch.float64) / sample_rate
    freq = 220.0 + 660.0 * t / max(seconds, 1e-6)
    phase = 2 * math.pi * torch.cumsum(freq, 0) / sample_rate
    envelope = 0.5 * (1 - torch.cos(2 * math.pi * t * 2.0))
    return (0.3 * envelope * torch.sin(phase)).float()


class Transcribe(Example):
    """Log-mel features -> encoder once -> greedy decoder loop with KV cache."""

    def _features(self, model: torch.nn.Module, path: str | None) -> torch.Tensor:
        from transformers import WhisperFeatureExtractor

        cfg = model_config(model)
        if path is not None and (Path(path) / "preprocessor_config.json").exists():
            extractor = WhisperFeatureExtractor.from_pretrained(path, local_files_only=True)
            seconds = 30.0
        else:
            # Tiny models see a short window: 2 * max_source_positions mel frames of 10 ms.
            seconds = 2 * cfg.max_source_positions * 160 / SAMPLE_RATE
            extractor = WhisperFeatureExtractor(
                feature_size=cfg.num_mel_bins, chunk_length=max(1, round(seconds))
            )
        wave = synthetic_waveform(min(self.cfg.audio_seconds, seconds))
        feats = extractor(wave.numpy(), sampling_rate=SAMPLE_RATE, return_tensors="pt")
        frames = 2 * cfg.max_source_positions
        return feats.input_features[..., :frames].to(model_dtype(model))

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        start = model_config(model).decoder_start_token_id
        return {
            "input_features": self._features(model, None),
            "decoder_input_ids": torch.full((1, self.cfg.seq_len), start, dtype=torch.long),
        }

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs, use_cache=False).logits

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, *, path: str | None = None, **_: Any) -> dict[str, Any]:
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"{type(model).__name__} is not a transformers encoder-decoder model")
        features = self._features(model, path)
        encoder_out = model.get_encoder()(features)
        cfg = model_config(model)
        tokens: list[int] = [cfg.decoder_start_token_id]
        past = None
        for _step in range(self.cfg.new_tokens):
            step = torch.tensor([tokens[-1:] if past is not None else tokens])
            out = model(
                encoder_outputs=encoder_out,
                decoder_input_ids=step,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            if tokens[-1] == cfg.eos_token_id:
                break
        result: dict[str, Any] = {
            "audio_seconds": self.cfg.audio_seconds,
            "feature_shape": list(features.shape),
            "token_ids": tokens[1:],
        }
        if path is not None and (Path(path) / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            result["text"] = tok.decode(tokens[1:], skip_special_tokens=True)
        return result
