"""The strict pydantic base of hyperparallel's configurations (model shape, training run).

Unknown keys are refused, values are frozen, and what pydantic's lax mode would silently coerce is
refused: ``true`` for an integer or a float (lax mode reads it as 1, so ``batch_size=true`` would
train with batch 1) and non-finite floats (``timeout_s=inf``, ``muon_lr=nan``).
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class StrictModel(BaseModel):
    """Base of every hyperparallel configuration section."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # bool is an int subclass; the error's location names the field (data.batch_size).
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _is_number(field.annotation):
            raise ValueError(f"{value!r} is a boolean; expected a number")
        return value


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
