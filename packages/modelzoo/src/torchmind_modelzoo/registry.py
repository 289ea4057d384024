"""The card registry: every card shipped in ``modelzoo/cards`` plus out-of-tree registrations.

Loading reads YAML only (no torch model is imported); ``validate_all`` adds the library check.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from torchmind_modelzoo.schema import Category, ModelCard, Status
from torchmind_modelzoo.validate import CardError, check_library, load_card_file

_CARDS: dict[str, ModelCard] | None = None
_SOURCES: dict[str, str] = {}
_EXTRA: dict[str, ModelCard] = {}


def cards_dir() -> Path:
    """Directory of the shipped card files (``cards/<category>/<id>.yaml``)."""
    return Path(str(resources.files("torchmind_modelzoo") / "cards"))


def _shipped() -> dict[str, ModelCard]:
    global _CARDS
    if _CARDS is None:
        cards: dict[str, ModelCard] = {}
        for path in sorted(cards_dir().glob("*/*.yaml")):
            card = load_card_file(path)
            if card.id in cards:
                raise CardError(path.name, "id", f"duplicate id {card.id!r}")
            cards[card.id] = card
            _SOURCES[card.id] = f"{path.parent.name}/{path.name}"
        _CARDS = cards
    return _CARDS


def _all() -> dict[str, ModelCard]:
    return {**_shipped(), **_EXTRA}


def get(name: str) -> ModelCard:
    """Return the card called ``name``.

    Raises:
        KeyError: with the closest known ids when there is no such card.
    """
    cards = _all()
    if name in cards:
        return cards[name]
    import difflib

    close = difflib.get_close_matches(name, cards, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see `modelzoo list`"
    raise KeyError(f"no model card {name!r}{hint}")


def list(
    category: Category | str | None = None, status: Status | str | None = None
) -> builtins.list[ModelCard]:
    """Cards sorted by category then id, optionally filtered.

    Args:
        category: keep one category (enum or its value, e.g. ``"llm"``).
        status: keep ``"full"`` or ``"listed"`` cards.
    """
    cat = Category(category) if category is not None else None
    st = Status(status) if status is not None else None
    order = {c: i for i, c in enumerate(Category)}
    cards = [
        c
        for c in _all().values()
        if (cat is None or c.category is cat) and (st is None or c.status is st)
    ]
    return sorted(cards, key=lambda c: (order[c.category], c.id))


def register(card: ModelCard | str | Path, *, replace: bool = False) -> ModelCard:
    """Add an out-of-tree card (a ModelCard or a YAML file path) to the registry.

    Raises:
        ValueError: if the id is taken and ``replace`` is False.
        CardError: if a file does not validate.
    """
    if not isinstance(card, ModelCard):
        path = Path(card)
        card = load_card_file(path)
        source = str(path)
    else:
        source = f"<registered {card.id}>"
    if card.id in _all() and not replace:
        raise ValueError(f"card id {card.id!r} is already registered; pass replace=True")
    _EXTRA[card.id] = card
    _SOURCES[card.id] = source
    return card


def unregister(name: str) -> None:
    """Remove an out-of-tree card (shipped cards cannot be removed)."""
    if name not in _EXTRA:
        raise KeyError(f"{name!r} is not an out-of-tree card")
    del _EXTRA[name]


def source_of(name: str) -> str:
    """File (relative to the cards folder) or label a card was read from."""
    get(name)
    return _SOURCES[name]


def validate_all(cards: Iterable[ModelCard] | None = None) -> dict[str, str | None]:
    """Run the library check on every card.

    Returns:
        card id -> None (checked) or the reason the library check was skipped.

    Raises:
        CardError: on the first card the installed library contradicts.
    """
    cards = _all().values() if cards is None else cards
    return {c.id: check_library(c, source_of(c.id)) for c in cards}
