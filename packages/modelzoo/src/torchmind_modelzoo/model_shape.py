"""Which model a card run trains: the card's tiny shape, its published shape (``--full-size``,
optionally cut to fewer layers), or a local folder; and the config values of a random-weight one.

The published shape is the card's ``config`` (the hub's config.json architecture values, kept in
the card because nothing is downloaded). ``--layers N`` keeps every dimension as published and
only the first N decoder layers, so that a run measures the real proportions of one layer (its
matrices, experts, vocabulary) on a machine that cannot hold them all.
"""

from __future__ import annotations

from typing import Any

from torchmind_modelzoo import registry
from torchmind_modelzoo.build import tiny_overrides
from torchmind_modelzoo.checks import InputError, check_source
from torchmind_modelzoo.options import TrainOptions
from torchmind_modelzoo.schema import ModelCard

LAYERS_KEY = "num_hidden_layers"
"""The transformers config field ``--layers`` replaces."""


def full_size_cards() -> list[ModelCard]:
    """The cards that carry a published config (those ``--full-size`` takes)."""
    return [card for card in registry.list() if card.config is not None]


def check_model_source(card: ModelCard, options: TrainOptions) -> None:
    """Exactly one of ``--tiny``, ``--full-size``, ``--path``; ``--layers`` only with
    ``--full-size`` and within the card's layers; a ``--path`` folder as :func:`check_source`
    wants it.

    Raises:
        InputError: one line naming the options and what to give instead.
    """
    if options.full_size and options.tiny:
        raise InputError(
            "--full-size and --tiny exclude each other (the published shape or the tiny one, "
            "both random weights); give one"
        )
    if options.full_size and options.path is not None:
        raise InputError(
            f"--full-size builds random weights and would ignore --path {str(options.path)!r}; "
            "give --full-size or --path, not both"
        )
    if options.layers is not None and not options.full_size:
        raise InputError(
            f"--layers {options.layers} applies only with --full-size (it keeps the first N "
            "layers of the card's published config)"
        )
    if options.full_size:
        _check_full_size(card, options.layers)
        return
    if not options.tiny and options.path is None:
        raise InputError(
            f"{card.id}: give --tiny (random weights, offline) or --path DIR (a local copy of "
            f"{card.hub_id}; modelzoo never fetches weights), or --full-size (the published "
            "shape, random weights)"
        )
    check_source(card, tiny=options.tiny, path=options.path)


def _check_full_size(card: ModelCard, layers: int | None) -> None:
    if card.config is None:
        names = ", ".join(c.id for c in full_size_cards())
        raise InputError(
            f"{card.id} has no published config in its card (config:); --full-size trains {names}"
        )
    if layers is None:
        return
    published = card.config.get(LAYERS_KEY)
    if not isinstance(published, int):
        raise InputError(f"--layers: {card.id}'s config has no {LAYERS_KEY} to cut")
    if layers > published:
        raise InputError(
            f"--layers {layers}: {card.id} has {LAYERS_KEY}={published}; give 1 to {published}"
        )


def config_values(card: ModelCard, options: TrainOptions) -> dict[str, Any]:
    """The keyword arguments of the card's config class for a random-weight run: the tiny
    overrides, or the published config with ``--layers`` applied."""
    if not options.full_size:
        return tiny_overrides(card)
    values = dict(card.config or {})
    if options.layers is not None:
        values[LAYERS_KEY] = options.layers
    return values
