"""``modelzoo plan``: what a card's published model needs at N ranks, from hyperparallel's planner.

The card's published config (``config:``) is written as a config.json in a temporary folder and
planned exactly as ``hyperparallel plan --model`` plans a folder, with the run configured as
``modelzoo train`` configures it (the card run's defaults, then ``--config`` and ``--set``).
Nothing is downloaded and no weights exist: the planner builds the model on the meta device.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from torchmind_modelzoo import training
from torchmind_modelzoo.build import LibraryMissingError
from torchmind_modelzoo.checks import InputError
from torchmind_modelzoo.model_shape import check_model_source
from torchmind_modelzoo.options import TrainOptions
from torchmind_modelzoo.schema import ModelCard


def plannable_cards() -> list[ModelCard]:
    """The full LLM cards that carry a published config."""
    return [card for card in training.trainable_cards() if card.config is not None]


def check_plannable(card: ModelCard) -> None:
    """Only a full LLM card with a published config can be planned at its real size.

    Raises:
        InputError: naming the card, why, and the cards that can be planned.
    """
    if card in plannable_cards():
        return
    names = ", ".join(c.id for c in plannable_cards())
    why = (
        "has no published config in its card (config:)"
        if card.config is None
        else ("is not a full LLM card")
    )
    raise InputError(f"{card.id} {why}; modelzoo plan takes {names}")


def plan_card(
    card: ModelCard,
    job: dict[str, Any],
    world: int,
    *,
    layers: int | None = None,
    device: str,
    search: bool,
    device_memory: str | None,
    efficiency: float | None,
    console: Console,
) -> None:
    """Print hyperparallel's plan of ``card`` at its published size on ``world`` ranks, or with
    its first ``layers`` decoder layers only (as ``modelzoo train --full-size --layers`` trains it).

    Raises:
        InputError: the card, a setting or the layout is refused (hyperparallel's one line).
        LibraryMissingError: hyperparallel or transformers is not installed.
    """
    check_plannable(card)
    options = TrainOptions(full_size=True, layers=layers, job=job)
    check_model_source(card, options)
    if importlib.util.find_spec("hyperparallel") is None:
        raise LibraryMissingError(
            "modelzoo plan needs hyperparallel: pip install 'torchmind-modelzoo[train]'"
        )
    from hyperparallel.plan.command import run_plan

    with tempfile.TemporaryDirectory(prefix="modelzoo-plan-") as folder:
        model = training.write_model_config(card, options, Path(folder))
        cfg = training.train_config(card, options, model)
        try:
            run_plan(
                cfg,
                world,
                device=device,
                search=search,
                device_memory=device_memory,
                efficiency=efficiency,
                console=console,
            )
        except (ValueError, FileNotFoundError) as exc:
            raise InputError(str(exc).replace(str(model), card.id)) from None
