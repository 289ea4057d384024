"""What every inference example provides: export inputs, an export wrapper, and a runnable demo.

Each :class:`~torchmind_modelzoo.schema.Task` maps to one ``Example`` subclass; the registry
imports the module that defines it only when a card asks for it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from torchmind_modelzoo.schema import ModelCard, Task

_EXAMPLES: dict[Task, str] = {
    Task.TEXT_GENERATION: "torchmind_modelzoo.examples.text:TextGeneration",
    Task.IMAGE_TEXT_GENERATION: "torchmind_modelzoo.examples.vision:VisionLanguage",
    Task.RERANK_LM: "torchmind_modelzoo.examples.text:RerankLM",
    Task.EMBEDDING: "torchmind_modelzoo.examples.embed:Embedding",
    Task.RERANK_CROSS_ENCODER: "torchmind_modelzoo.examples.embed:CrossEncoder",
    Task.IMAGE_TEXT: "torchmind_modelzoo.examples.embed:ImageText",
    Task.ASR: "torchmind_modelzoo.examples.speech:Transcribe",
    Task.IMAGE_DENOISE: "torchmind_modelzoo.examples.denoise:Denoise",
    Task.VIDEO_DENOISE: "torchmind_modelzoo.examples.denoise:Denoise",
}


class Example:
    """Base class: subclasses implement ``inputs``, ``forward`` and ``run``."""

    def __init__(self, card: ModelCard) -> None:
        if card.example is None:
            raise ValueError(f"{card.id} has no example (status {card.status.value!r})")
        self.card = card
        self.cfg = card.example

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Example tensors for the exported forward, keyed by argument name."""
        raise NotImplementedError

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        """The traced computation: plain tensors in, one tensor out."""
        raise NotImplementedError

    def run(self, model: torch.nn.Module, **options: Any) -> dict[str, Any]:
        """Run the inference example; returns a JSON-friendly summary."""
        raise NotImplementedError


class ExportWrapper(torch.nn.Module):
    """Module whose forward is ``example.forward(model, **inputs)``, for torch.export."""

    def __init__(self, example: Example, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self._example = example

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self._example.forward(self.model, **inputs)


def example_for(card: ModelCard) -> Example:
    """Instantiate the example class for a full card's task."""
    if card.example is None:
        raise ValueError(f"{card.id} is a listed card: no example to run")
    module, _, name = _EXAMPLES[card.example.task].partition(":")
    return getattr(importlib.import_module(module), name)(card)


def model_config(model: torch.nn.Module) -> Any:
    """The model's library config (transformers ``PretrainedConfig``, diffusers ``FrozenDict``).

    Its fields depend on the architecture, so they are read untyped; ``nn.Module.__getattr__``
    would type the attribute as a tensor or submodule.
    """
    config: Any = model.config
    return config


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The parameter dtype reported by the ``dtype`` property of transformers/diffusers models.

    Raises:
        TypeError: when ``model.dtype`` is not a ``torch.dtype`` (a submodule of that name).
    """
    dtype = model.dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{type(model).__name__}.dtype is {dtype!r}, not a torch.dtype")
    return dtype


def seeded_ids(vocab: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Deterministic token ids in ``[3, vocab)`` (low ids are often special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, shape, generator=gen)
