"""Decoder examples: greedy generation with a KV cache, and yes/no-logit reranking."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchmind_modelzoo.examples.base import Example, model_config, seeded_ids


def _vocab(model: torch.nn.Module) -> int:
    return int(model_config(model).get_text_config().vocab_size)


def _tokenizer(path: str | None) -> Any:
    """The tokenizer shipped with a local model folder, or None (tiny runs use token ids)."""
    if path is None or not (Path(path) / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class TextGeneration(Example):
    """Greedy decoding: one prefill, then one token per step through the model's KV cache."""

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {"input_ids": seeded_ids(_vocab(model), (1, self.cfg.seq_len))}

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        return model(input_ids=inputs["input_ids"], use_cache=False).logits

    @torch.inference_mode()
    def generate(
        self, model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int
    ) -> list[int]:
        """Greedy continuation of ``input_ids`` ([1, S] int64); returns the new token ids."""
        out = model(input_ids=input_ids, use_cache=True)
        past = out.past_key_values
        tokens: list[int] = []
        for _ in range(new_tokens):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past = out.past_key_values
        return tokens

    def run(
        self,
        model: torch.nn.Module,
        *,
        path: str | None = None,
        prompt: str = "The capital of France is",
        **_: Any,
    ) -> dict[str, Any]:
        tokenizer = _tokenizer(path)
        if tokenizer is None:
            ids = self.inputs(model)["input_ids"]
        else:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
        tokens = self.generate(model, ids, self.cfg.new_tokens)
        result: dict[str, Any] = {"prompt_ids": ids[0].tolist(), "new_token_ids": tokens}
        if tokenizer is not None:
            result["text"] = tokenizer.decode(tokens)
        return result


class RerankLM(Example):
    """Qwen3-Reranker style: relevance = P("yes") over {"yes", "no"} at the last position."""

    def _yes_no(self, model: torch.nn.Module, path: str | None) -> tuple[int, int]:
        tokenizer = _tokenizer(path)
        if tokenizer is None:
            vocab = _vocab(model)
            return vocab - 1, vocab - 2
        return tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {"input_ids": seeded_ids(_vocab(model), (2, self.cfg.seq_len))}

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        yes, no = self._yes_no(model, None)
        logits = model(input_ids=inputs["input_ids"], use_cache=False).logits[:, -1]
        return torch.log_softmax(logits[:, [no, yes]].float(), dim=-1)[:, 1].exp()

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, **_: Any) -> dict[str, Any]:
        scores = self.forward(model, **self.inputs(model))
        return {"pairs": int(scores.numel()), "scores": [round(float(s), 6) for s in scores]}
