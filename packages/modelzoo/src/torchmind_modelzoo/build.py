"""Model construction: a tiny random-weight instance from the card's config overrides, or the
real weights from a local directory. Never touches the network.

transformers and diffusers are imported here, lazily, so the rest of the package works
without them.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

from torchmind_modelzoo.checks import InputError
from torchmind_modelzoo.schema import ModelCard

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LibraryMissingError(RuntimeError):
    """The card's library is not installed; the message names the extra that provides it."""


def resolve_dtype(name: str) -> torch.dtype:
    """Map a dtype name (``float32``, ``bfloat16``, ``float16``) to ``torch.dtype``."""
    if name not in _DTYPES:
        raise InputError(f"--dtype {name!r} is not one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def model_class(card: ModelCard) -> type[Any]:
    """Import the card's architecture class from its library.

    Typed ``type[Any]``: its constructor and ``from_pretrained`` belong to the library.

    Raises:
        LibraryMissingError: when the library is not installed.
    """
    try:
        module = importlib.import_module(card.package)
    except ImportError:
        extra = "diffusers" if card.library == "diffusers" else card.package
        raise LibraryMissingError(
            f"{card.id} needs {card.package!r}: pip install 'torchmind-modelzoo[{extra}]'"
        ) from None
    return getattr(module, card.architecture)


def tiny_overrides(card: ModelCard, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The card's tiny overrides merged with ``extra`` (nested dicts merge key by key)."""
    merged = dict(card.tiny)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def build_model(
    card: ModelCard,
    *,
    tiny: bool,
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """Build the card's model in eval mode.

    Args:
        card: the model card.
        tiny: build from ``card.tiny`` overrides with random weights (seeded) instead of loading.
        path: local directory with the released files (required when ``tiny`` is False); for
            diffusers a pipeline folder (its ``transformer/`` subfolder is used) or a model folder.
        dtype: parameter dtype.
        seed: RNG seed for the random weights.
        trust_remote_code: passed to transformers only when the user asks for it.

    Raises:
        LibraryMissingError: when the library is not installed.
        FileNotFoundError: when ``path`` is missing for a non-tiny build.
    """
    cls = model_class(card)
    if tiny:
        torch.manual_seed(seed)
        overrides = tiny_overrides(card)
        if card.library == "transformers":
            config = cls.config_class(**overrides)
            model = cls(config)
        else:
            model = cls(**overrides)
        if dtype != torch.float32:
            model = model.to(dtype)
        return model.eval()
    if path is None or not Path(path).is_dir():
        raise FileNotFoundError(
            f"{card.id}: without --tiny a local model directory is needed (got {path!r}); "
            f"download {card.hub_id} yourself, modelzoo never fetches weights"
        )
    path = Path(path)
    if card.library == "diffusers":
        sub = {"subfolder": "transformer"} if (path / "transformer").is_dir() else {}
        model = cls.from_pretrained(path, torch_dtype=dtype, local_files_only=True, **sub)
    else:
        model = cls.from_pretrained(
            path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
        )
    return model.eval()
