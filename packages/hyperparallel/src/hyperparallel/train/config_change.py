"""On ``--resume``: the settings that define what is trained, compared with the run's own.

A checkpoint loads into any model of the same tensor shapes, so a resume with other attention
heads, another corpus or other sequence windows trains on silently, and its metrics no longer
describe one run. The run's configuration is kept in ``metrics.json`` (written with every
checkpoint); a resume that changes the model or the data is refused, naming the fields, unless
the user says the change is intended. How the data is consumed (batch sizes, the mesh, the
optimizer, the schedule) may change: DCP reshards and the step count carries on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hyperparallel.train.config import TrainConfig

DATA_FIELDS = ("data.path", "data.max_bytes", "data.seq_len", "data.val_fraction", "seed")
"""The corpus, its held-out split, the windows and their order."""
HF_FIELDS = ("hf.source", "hf.overrides", "hf.tokenizer")
"""The transformers model and its tokenizer (the weights come from the checkpoint)."""
DTYPE_FIELD = "dtype"
"""The parameters' dtype, of either model: a resume in another dtype continues other numerics."""


def compared_fields(config: dict[str, Any]) -> list[str]:
    """Dotted names of the model and data settings of ``config`` (a ``model_dump``)."""
    hf = config.get("hf") or {}
    if hf.get("source") is None:
        model = [f"model.{name}" for name in sorted(config.get("model") or {})]
    else:
        model = list(HF_FIELDS)
    return [*model, DTYPE_FIELD, *DATA_FIELDS]


_MISSING = object()


def _value(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def changed_fields(saved: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, new value)`` for each model or data setting that differs.

    Fields the saved configuration does not have (an older version wrote it) are not compared.
    """
    fields = dict.fromkeys([*compared_fields(saved), *compared_fields(new)])
    changes = []
    for name in fields:
        old, now = _value(saved, name), _value(new, name)
        if old is not _MISSING and now is not _MISSING and old != now:
            changes.append((name, old, now))
    return changes


def saved_config(out_dir: Path) -> dict[str, Any] | None:
    """The configuration stored with the run in ``out_dir`` (``metrics.json``), or None."""
    try:
        config = json.loads((out_dir / "metrics.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return config if isinstance(config, dict) else None


def check_resume_config(cfg: TrainConfig, *, allow_change: bool) -> str | None:
    """Refuse a resume that changes the model or the data; returns a warning (nothing to
    compare with, or the changes ``allow_change`` accepted), else None.

    Raises:
        ValueError: naming each changed field with its saved and new value.
    """
    out = Path(cfg.out_dir)
    saved = saved_config(out)
    if saved is None:
        return (
            f"--resume: {out / 'metrics.json'} holds no configuration of the run; resuming "
            "without comparing its model and data settings"
        )
    new = json.loads(json.dumps(cfg.model_dump()))  # the form metrics.json stores
    changes = changed_fields(saved, new)
    if not changes:
        return None
    listed = ", ".join(f"{name} {old!r} -> {now!r}" for name, old, now in changes)
    if allow_change:
        return f"--resume with changed model or data settings (--allow-config-change): {listed}"
    raise ValueError(
        f"--resume: this run changes the model or data settings of the run in {out}: "
        f"{listed}; restore them, or pass --allow-config-change if the change is intended"
    )
