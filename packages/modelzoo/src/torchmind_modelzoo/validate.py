"""Card loading and validation: YAML -> ModelCard, errors that name the file and the field.

Schema errors come from pydantic; the library check (does the pinned transformers/diffusers
have the architecture class?) is done here because it needs the library installed. A card whose
library is missing is not an error: the check is skipped and reported as such.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from torchmind_modelzoo.schema import ModelCard


class CardError(ValueError):
    """A card file that does not describe a valid model; names the file and the field."""

    def __init__(self, source: str, field: str, message: str) -> None:
        self.source = source
        self.field = field
        super().__init__(f"{source}: field '{field}': {message}")


def parse_card(data: Any, source: str) -> ModelCard:
    """Validate a mapping against the schema.

    Args:
        data: the mapping read from a card file.
        source: file name (or other label) used in error messages.

    Raises:
        CardError: for the first schema violation, naming the field.
    """
    if not isinstance(data, dict):
        raise CardError(source, "<root>", f"expected a mapping, got {type(data).__name__}")
    try:
        return ModelCard.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        kind = err["type"]
        if kind == "extra_forbidden":
            message = "unknown field (not in the card schema)"
        elif kind == "missing":
            message = "required field is missing"
        else:
            message = f"{err['msg']} (got {err.get('input')!r})"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise CardError(source, field, message + more) from None


def load_card_file(path: str | Path) -> ModelCard:
    """Read and validate one YAML card file; the file stem must equal the card id."""
    path = Path(path)
    source = str(path.name if path.parent.name == "" else f"{path.parent.name}/{path.name}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise CardError(source, "<root>", f"not valid YAML: {exc}") from None
    card = parse_card(data, source)
    if path.stem != card.id:
        raise CardError(source, "id", f"id {card.id!r} must equal the file name {path.stem!r}")
    if path.parent.name in {c.value for c in type(card.category)} and (
        path.parent.name != card.category.value
    ):
        raise CardError(
            source, "category", f"{card.category.value!r} but the file is in {path.parent.name}/"
        )
    return card


@cache
def _library_names(package: str) -> frozenset[str] | None:
    """Public names of an installed library, or None when it is not installed."""
    if importlib.util.find_spec(package) is None:
        return None
    module = importlib.import_module(package)
    # transformers and diffusers are lazy modules: dir() lists every class without importing it.
    return frozenset(dir(module))


def check_library(card: ModelCard, source: str) -> str | None:
    """Check that the installed library has the card's architecture class.

    Returns:
        None when checked, or the reason the check was skipped (library not installed,
        class from remote code).

    Raises:
        CardError: naming the ``architecture`` field when the installed library lacks the class.
    """
    if card.remote_code:
        return f"{card.architecture} is remote code from {card.hub_id}"
    names = _library_names(card.package)
    if names is None:
        return f"library {card.package!r} is not installed"
    if card.architecture not in names:
        version = getattr(importlib.import_module(card.package), "__version__", "?")
        raise CardError(
            source,
            "architecture",
            f"{card.architecture!r} is not a class of the installed {card.package} {version}",
        )
    return None
