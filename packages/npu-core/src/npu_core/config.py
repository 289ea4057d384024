"""One strict configuration base for every package: unknown keys refused, frozen, fingerprinted.

Settings are pydantic models deriving from :class:`StrictConfig`. A run is configured in layers,
each validated as a whole so that an error names the field: the model's defaults (or a preset),
then a TOML file, then ``section.field=value`` overrides (:meth:`StrictConfig.load`). What pydantic
would silently coerce and a user would not expect is refused: ``true`` for an integer or a float
(pydantic's lax mode reads it as 1), a key the model does not have, a section given a scalar.

:meth:`StrictConfig.fingerprint` hashes the validated values, so caches and run folders can tell
two configurations apart without trusting field order or formatting.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line naming key, value and rule."""


class StrictConfig(BaseModel):
    """Base of every package's settings.

    Subclasses declare fields with ``pydantic.Field(default, description=...)``; the description
    is the ``--help`` text of the generated command-line option (:mod:`npu_core.cli`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # bool is an int subclass, and pydantic's lax mode turns `true` into 1 or 1.0: a typo
        # such as `batch_size=true` would train with batch 1. Numbers must be numbers.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _is_number(field.annotation):
            raise ValueError("a boolean is not a number")
        return value

    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the validated values (stable across processes)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @classmethod
    def load(
        cls,
        base: Self | dict[str, Any] | None = None,
        toml_path: str | Path | None = None,
        overrides: list[str] | None = None,
        *,
        override_flag: str = "--set",
    ) -> Self:
        """Layer a TOML file, then ``key.sub=value`` overrides, over ``base`` and validate.

        Args:
            base: starting values (an instance, a dict, or None for the defaults).
            toml_path: a TOML file whose tables mirror the model's sections.
            overrides: ``section.field=value`` items; values use TOML's scalar grammar
                (``3``, ``0.5``, ``true``, ``"text"``, ``[1, 2]``), bare words stay strings.
            override_flag: how the overrides were given, for error messages.

        Raises:
            ConfigError: one line naming every invalid key, its value and what is allowed.
        """
        return cls.validate_tree(layer_tree(base, toml_path, overrides, override_flag))

    @classmethod
    def validate_tree(cls, tree: dict[str, Any]) -> Self:
        """Validate a nested dict, turning pydantic's report into one :class:`ConfigError` line."""
        try:
            return cls.model_validate(tree)
        except ValidationError as exc:
            raise ConfigError(f"invalid configuration: {describe_errors(exc, cls)}") from None


def layer_tree(
    base: StrictConfig | dict[str, Any] | None = None,
    toml_path: str | Path | None = None,
    overrides: list[str] | None = None,
    override_flag: str = "--set",
) -> dict[str, Any]:
    """The layers of :meth:`StrictConfig.load` as a plain dict, not validated yet.

    For callers that add a further layer (command-line options) before the one validation, so
    that a required field may come from any layer.
    """
    tree = base.model_dump() if isinstance(base, StrictConfig) else dict(base or {})
    if toml_path is not None:
        merge(tree, read_toml(toml_path))
    for item in overrides or []:
        key, value = parse_override(item, override_flag)
        set_dotted(tree, key, value, override_flag)
    return tree


def describe_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """``key.path: message (got value)`` for each error, joined by ``; ``.

    Given the validated ``model``, an unknown key also lists the settings its section does
    have (``choose one of ...``): a misspelt key is then fixed from the error line alone,
    without a trip to ``--help``.
    """
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        got = error.get("input")
        shown = "" if isinstance(got, dict) or error["type"] == "missing" else f" (got {got!r})"
        if error["type"] == "extra_forbidden" and model is not None:
            fields = _section_fields(model, error["loc"][:-1])
            if fields:
                shown += f", choose one of {', '.join(fields)}"
        # a check across fields (a model validator) has no location; its message names them
        parts.append(f"{where}: {message}{shown}" if where else message)
    return "; ".join(parts)


def _section_fields(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the section of ``model`` at ``loc`` (empty when it is no section)."""
    section: Any = model
    for part in loc:
        field = section.model_fields.get(part) if isinstance(part, str) else None
        section = None if field is None else field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return []
    return list(section.model_fields)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; a missing file or bad syntax is a :class:`ConfigError`."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {file}: no such file")
    try:
        return tomllib.loads(file.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {file}: not valid TOML: {exc}") from None


def parse_override(item: str, flag: str = "--set") -> tuple[str, Any]:
    """Split ``key.sub=value`` and read the value with TOML's scalar grammar."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"{flag} {item!r}: expected key=value or section.key=value")
    return key, parse_value(text.strip())


def parse_value(text: str) -> Any:
    """``3`` -> 3, ``0.5`` -> 0.5, ``true`` -> True, ``"x"``/``x`` -> "x", ``[1, 2]`` -> list."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def set_dotted(tree: dict[str, Any], dotted: str, value: Any, flag: str = "--set") -> None:
    """Set ``tree["a"]["b"] = value`` for ``dotted="a.b"``, creating sections as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for depth, key in enumerate(parents):
        child = node.setdefault(key, {})
        if isinstance(child, BaseModel):
            child = node[key] = child.model_dump()
        if not isinstance(child, dict):
            section = ".".join(parents[: depth + 1])
            raise ConfigError(f"{flag} {dotted}: {section} is a value, not a section")
        node = child
    node[leaf] = value


def merge(tree: dict[str, Any], update: dict[str, Any]) -> None:
    """Deep-merge ``update`` into ``tree``: tables merge key by key, everything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            merge(tree[key], value)
        else:
            tree[key] = value


def _is_number(annotation: Any) -> bool:
    """True for ``int``, ``float`` and optionals/unions made only of numbers and None."""
    if annotation in (int, float):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_number(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return bool(members) and all(_is_number(arg) for arg in members)
    return False
