"""Input checks that run before any model is built: card files, model folders, output folders.

Every check raises :class:`InputError` with one line naming the argument, the value and what is
allowed, so that a wrong path costs nothing: no model build, no export, nothing written. The
CLI turns it into exit status 2.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from npu_core.files import UnwritableFolderError, check_writable_folder
from torchmind_modelzoo.schema import ModelCard

ARTEFACTS = ("model.pt2", "model.safetensors", "config.json", "manifest.json")
"""Files ``modelzoo convert`` writes into ``--out``; ``--overwrite`` replaces only these."""

_BINARY_PROBE_BYTES = 8192


class InputError(ValueError):
    """A command-line or API argument refused before any work started (exit status 2)."""


def check_card_file(path: str | os.PathLike[str]) -> Path:
    """A card file to validate must exist, be a file, and hold UTF-8 text.

    Raises:
        InputError: naming the path and what it is instead.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"card file {str(path)!r} does not exist")
    if path.is_dir():
        raise InputError(f"card file {str(path)!r} is a folder; give the card's .yaml file")
    if not path.is_file():
        raise InputError(f"card file {str(path)!r} is not a regular file")
    try:
        with path.open("rb") as handle:
            head = handle.read(_BINARY_PROBE_BYTES)
    except OSError as exc:
        raise InputError(f"card file {str(path)!r} cannot be read: {exc.strerror}") from None
    if b"\0" in head:
        raise InputError(f"card file {str(path)!r} is a binary file, not a YAML card")
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"card file {str(path)!r} is not UTF-8 text (byte {exc.start}); cards are YAML"
        ) from None
    return path


def check_source(
    card: ModelCard, *, tiny: bool, path: str | os.PathLike[str] | None
) -> Path | None:
    """Exactly one weight source: ``tiny`` (random weights) or a local model folder.

    A folder must hold the files ``from_pretrained`` reads first (``config.json``; for diffusers
    a pipeline folder with ``transformer/config.json`` or a model folder), so that an empty or
    wrong folder is refused here instead of by a library traceback after the imports.

    Raises:
        InputError: both or neither given, or the folder is missing, not a folder or empty.
    """
    if tiny and path is not None:
        raise InputError(
            f"--tiny builds random weights and would ignore --path {str(path)!r}; "
            "give --tiny or --path, not both"
        )
    if tiny:
        return None
    if path is None:
        raise InputError(
            f"{card.id}: give --tiny (random weights, offline) or --path DIR (a local copy of "
            f"{card.hub_id}; modelzoo never fetches weights)"
        )
    folder = Path(path)
    if not folder.exists():
        raise InputError(f"--path {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise InputError(f"--path {str(folder)!r} is a file; give the model's folder")
    wanted = [folder / "config.json"]
    if card.library == "diffusers":
        wanted.insert(0, folder / "transformer" / "config.json")
    if not any(candidate.is_file() for candidate in wanted):
        names = " or ".join(str(c.relative_to(folder)) for c in wanted)
        state = "is empty" if not any(folder.iterdir()) else f"has no {names}"
        raise InputError(
            f"--path {str(folder)!r} {state}: expected a local copy of {card.hub_id} ({names})"
        )
    if card.example is not None and card.example.expert_boundary is not None:
        second = folder / "transformer_2"
        if not (second / "config.json").is_file():
            raise InputError(
                f"--path {str(folder)!r}: {card.id} is a two-expert model and "
                f"{second.name}/config.json is missing"
            )
    return folder


def check_out_dir(out: str | os.PathLike[str], *, overwrite: bool) -> Path:
    """``--out`` must be a folder that is absent, empty, or (with ``overwrite``) a conversion.

    Refused: a path that is a file (``--overwrite`` never deletes a file it did not write), a
    folder holding a previous conversion unless ``overwrite``, a folder holding anything else
    (``overwrite`` replaces only :data:`ARTEFACTS`, so other files would be mixed in), and a
    place that cannot be written (:func:`npu_core.files.check_writable_folder`, which creates
    nothing).

    Raises:
        InputError: naming ``--out``, the path and what to do.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {str(out)!r} is a file; give a folder for the artefacts")
    if out.is_dir():
        present = sorted(p.name for p in out.iterdir())
        ours = [name for name in present if name in ARTEFACTS]
        others = [name for name in present if name not in ARTEFACTS]
        if others:
            raise InputError(
                f"--out {str(out)!r} already holds other files ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}); give a new or empty folder"
            )
        if ours and not overwrite:
            raise InputError(
                f"--out {str(out)!r} already holds a conversion ({', '.join(ours)}); "
                "pass --overwrite to replace it, or give a new folder"
            )
    try:
        check_writable_folder(out)
    except UnwritableFolderError as exc:
        raise InputError(f"--out {exc}") from None
    return out


@contextlib.contextmanager
def output_folder(out: Path) -> Iterator[Path]:
    """Create ``out`` for the block; remove it again if the block fails and left it empty."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {str(out)!r} cannot be created: {exc.strerror}") from None
    try:
        yield out
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
