"""Does a model folder's weight files fit its ``config.json``? Answered without reading weights.

``transformers``' ``from_pretrained`` fills every parameter it finds no tensor for with random
values and only warns, so a folder whose weights come from another model (or another size of
the same one) would train from a partly random start in every rank. :func:`check_weights` reads
only the tensor names and shapes (the safetensors header; a ``pytorch_model.bin`` mapped onto
the meta device) and compares them with the model the config builds on the meta device, as the
library saves it (``save_pretrained`` reverts the library's load-time conversions, such as
per-expert tensors fused into one stack) or under the model's own parameter names.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Shapes = dict[str, tuple[int, ...]]
"""Tensor name -> shape."""

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The files ``from_pretrained`` loads a folder's weights from, in the order it looks for them."""

HEADER_LIMIT = 100_000_000
"""Largest safetensors header accepted (the format's own readers refuse above this size)."""

SHOWN = 3
"""Names given in a refusal per kind of difference; the rest are counted."""


def weight_files(folder: Path) -> list[Path]:
    """The weight files ``from_pretrained`` would read from ``folder``: the first of
    :data:`WEIGHT_FILES` present, an index replaced by the shards it names.

    Raises:
        FileNotFoundError: none of :data:`WEIGHT_FILES`, or a shard an index names is missing.
        ValueError: an index that is not JSON with a ``weight_map``.
    """
    name = next((n for n in WEIGHT_FILES if (folder / n).is_file()), None)
    if name is None:
        raise FileNotFoundError(
            f"--load-weights: {folder} holds none of {', '.join(WEIGHT_FILES)} (the files "
            "transformers loads weights from)"
        )
    if not name.endswith(".index.json"):
        return [folder / name]
    index = folder / name
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"--load-weights: {index} is not an index with a weight_map") from None
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--load-weights: {index} names {len(missing)} shard(s) the folder does not hold: "
            f"{', '.join(missing[:SHOWN])}"
        )
    return [folder / shard for shard in shards]


def read_shapes(path: Path) -> Shapes:
    """Names and shapes of the tensors in one weight file; no tensor data is read.

    Raises:
        ValueError: a file that is not a safetensors file (or a loadable ``.bin``).
    """
    if path.suffix == ".bin":
        try:
            state = torch.load(path, map_location="meta", mmap=True, weights_only=True)
        except Exception as exc:  # torch raises several kinds for a damaged archive
            raise ValueError(f"--load-weights: {path} does not load ({exc})") from None
        return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return _safetensors_shapes(path)


def _safetensors_shapes(path: Path) -> Shapes:
    """The header of a safetensors file: 8 bytes of little-endian length, then that much JSON."""
    refused = f"--load-weights: {path} is not a safetensors file"
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{refused} (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(HEADER_LIMIT, path.stat().st_size - 8):
            raise ValueError(f"{refused} (header length {length} past the end of the file)")
        try:
            header = json.loads(file.read(length))
            return {
                name: tuple(int(d) for d in entry["shape"])
                for name, entry in header.items()
                if name != "__metadata__"
            }
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{refused} (its header is not a tensor table)") from None


@dataclass(frozen=True)
class ExpectedWeights:
    """What the model a config builds loads, as the library saves it and as it holds it.

    Attributes:
        saved: names and shapes ``save_pretrained`` writes (load-time conversions reverted).
        native: the model's own state dict (what a folder saved without reverting holds).
        tied: names tied to another tensor, which a file may hold or leave out.
        ignore_missing: patterns of names the library loads without (its own list).
        ignore_unexpected: patterns of names the library skips in a file (its own list).
    """

    saved: Shapes
    native: Shapes
    tied: frozenset[str]
    ignore_missing: tuple[str, ...]
    ignore_unexpected: tuple[str, ...]


def expected_weights(config: Any) -> ExpectedWeights:
    """The tensors ``AutoModelForCausalLM.from_pretrained`` fills for ``config``, from the
    model built by the same class on the meta device (no memory, no weights)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    untied = remove_tied_weights_from_state_dict(dict(state), model)
    saved = revert_weight_conversion(model, dict(untied))
    return ExpectedWeights(
        saved={k: tuple(v.shape) for k, v in saved.items()},
        native={k: tuple(v.shape) for k, v in state.items()},
        tied=frozenset(state) - frozenset(untied),
        ignore_missing=tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
    )


def check_weights(folder: Path, config: Any) -> None:
    """Refuse a folder whose weight files do not fit ``config``: a tensor of another shape, a
    parameter with no tensor (it would start random), or a tensor the model has no place for.

    The file is compared with the layout it shares the most names with: the library's saved
    one (``save_pretrained``, hub checkpoints) or the model's own parameter names.

    Raises:
        FileNotFoundError: no weight file transformers loads (see :func:`weight_files`).
        ValueError: one line naming the folder, the first differing tensors with both shapes,
            and the missing and unexpected names, counted.
    """
    found: Shapes = {}
    source: dict[str, str] = {}
    for path in weight_files(folder):
        shapes = read_shapes(path)
        found.update(shapes)
        source.update(dict.fromkeys(shapes, path.name))
    expected = expected_weights(config)
    layout = max(expected.saved, expected.native, key=lambda names: len(names.keys() & found))
    differ = [n for n in layout if n in found and found[n] != layout[n]]
    missing = [
        n
        for n in layout
        if n not in found and n not in expected.tied and not _matches(n, expected.ignore_missing)
    ]
    unexpected = [
        n
        for n in found
        if n not in layout
        and n not in expected.tied
        and not _matches(n, expected.ignore_unexpected)
    ]
    if not (differ or missing or unexpected):
        return
    parts = []
    if differ:
        shown = "; ".join(
            f"{n}: {list(found[n])} in {source[n]}, {list(layout[n])} from config.json"
            for n in differ[:SHOWN]
        )
        parts.append(f"{len(differ)} tensor(s) of another shape ({shown})")
    if missing:
        parts.append(f"{len(missing)} missing ({_listed(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} not in the model ({_listed(unexpected)})")
    raise ValueError(
        f"--load-weights: the weights in {folder} do not fit its config.json: "
        f"{', '.join(parts)}; weights and config.json must come from the same model"
    )


def _listed(names: list[str]) -> str:
    """The first :data:`SHOWN` names, and an ellipsis for the rest."""
    more = ", ..." if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(re.search(pattern, name) for pattern in patterns)
