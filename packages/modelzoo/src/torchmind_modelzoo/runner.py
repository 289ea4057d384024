"""``modelzoo run``: build a full card's model and run its inference example.

Video cards whose conversion config carries liteboost options are boosted through
``liteboost.BoostManager`` / ``liteboost.ParallelManager`` when liteboost provides them; the
result records whether the boost was applied and why not.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import torch

from torchmind_modelzoo.build import build_model, resolve_dtype
from torchmind_modelzoo.checks import InputError, check_source
from torchmind_modelzoo.examples.base import example_for
from torchmind_modelzoo.schema import ModelCard


def _apply_liteboost(card: ModelCard, model: torch.nn.Module, tiny: bool) -> dict[str, Any]:
    """Apply the card's liteboost options; returns what was done (or why not)."""
    options = dict(card.convert.liteboost) if card.convert else {}
    if tiny and options and card.example is not None:
        options.update(card.example.boost_overrides)
    if not options:
        return {"applied": False, "reason": "card has no liteboost options"}
    if importlib.util.find_spec("liteboost") is None:
        return {"applied": False, "reason": "liteboost is not installed"}
    liteboost = importlib.import_module("liteboost")
    if not hasattr(liteboost, "BoostManager"):
        return {"applied": False, "reason": "this liteboost version has no BoostManager"}
    ulysses = options.pop("ulysses_degree", None)
    vae_parallel = options.pop("vae_parallel", True)
    liteboost.BoostManager(model, **options)
    applied: dict[str, Any] = {"applied": True, "options": options}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1 and hasattr(liteboost, "ParallelManager"):
        # The card's degree is sized for the full model; a launch with fewer ranks uses them all.
        degree = (
            ulysses if ulysses is not None and ulysses <= world and world % ulysses == 0 else None
        )
        manager = liteboost.ParallelManager(model, ulysses_degree=degree, vae_parallel=vae_parallel)
        applied["ulysses_degree"] = manager.config.ulysses_degree
    return applied


def run(
    card: ModelCard,
    *,
    tiny: bool,
    path: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    boost: bool = True,
    trust_remote_code: bool = False,
    mfusion: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Run the card's inference example.

    Args:
        card: a full card.
        tiny: random-weight tiny model (offline) instead of loading ``path``.
        path: local model directory when ``tiny`` is False (not both).
        dtype: parameter dtype (default: float32 for tiny, the card's precision otherwise).
        boost: apply the card's liteboost options (video cards).
        trust_remote_code: forwarded to transformers only when asked for.
        mfusion: compile the model with Inductor and the card's mfusion options
            (:mod:`torchmind_modelzoo.fusion`) before running; off by default because compiling
            costs far more than the tiny examples themselves.
        **options: example options (``prompt=`` for text generation).

    Returns:
        The example's JSON-friendly result plus timing, boost and mfusion information.

    Raises:
        InputError: before any work, for a listed card, a bad dtype or a wrong weight source.
    """
    if card.example is None or card.convert is None:
        raise InputError(f"{card.id} is a listed card: it has no runnable example")
    torch_dtype = resolve_dtype(dtype or ("float32" if tiny else card.convert.dtype))
    folder = check_source(card, tiny=tiny, path=path)
    fusion = None
    if mfusion:
        from torchmind_modelzoo.fusion import MFusionApplied

        fusion = MFusionApplied(card)
    start = time.perf_counter()
    model = build_model(
        card, tiny=tiny, path=path, dtype=torch_dtype, trust_remote_code=trust_remote_code
    )
    second = None
    if card.example.expert_boundary is not None:
        if tiny:
            second = build_model(card, tiny=True, dtype=torch_dtype, seed=1)
        else:
            assert folder is not None  # check_source returns the folder when not tiny
            second = _load_second_expert(card, folder, torch_dtype)
    boosted = {"applied": False, "reason": "disabled"}
    if boost:
        boosted = _apply_liteboost(card, model, tiny)
        if second is not None and boosted.get("applied"):
            _apply_liteboost(card, second, tiny)
    if fusion is not None:
        for module in (model, second):
            if module is not None:
                fusion.compile_module(module)
    built = time.perf_counter()
    result = example_for(card).run(
        model, path=None if path is None else str(path), second=second, **options
    )
    done = time.perf_counter()
    return {
        "card": card.id,
        "task": card.example.task.value,
        "tiny": tiny,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "liteboost": boosted,
        "mfusion": fusion.summary() if fusion is not None else {"applied": False},
        "build_seconds": round(built - start, 3),
        "run_seconds": round(done - built, 3),
        "result": result,
    }


def _load_second_expert(card: ModelCard, path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from torchmind_modelzoo.build import model_class

    folder = path / "transformer_2"
    if not folder.is_dir():
        raise FileNotFoundError(f"{card.id} is a two-expert model: {folder} is missing")
    return (
        model_class(card).from_pretrained(folder, torch_dtype=dtype, local_files_only=True).eval()
    )
