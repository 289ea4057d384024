"""Distributed checkpoints (torch.distributed.checkpoint) that are complete or absent, never half.

Each checkpoint is written into a temporary folder and renamed into place by rank 0 once every
rank has finished writing; the ``latest`` pointer file is then replaced atomically. A crash while
saving leaves only a ``.tmp-*`` folder, which loading ignores. DCP stores sharded tensors by
fully-qualified name, so a run can resume on a different number of ranks.

A checkpoint that was complete can still be damaged later (a truncated copy, a deleted file, a
full disk during a sync). So each one carries a manifest of its files with sizes and SHA-256
digests, written last, and :func:`latest` returns the newest checkpoint whose files match it,
naming every newer one it skipped and why, instead of failing deep inside DCP on the first.

After each save, :func:`prune` keeps the newest ``keep`` step folders (``--keep-checkpoints``)
and never removes the newest intact one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from npu_core.files import sha256_file, write_text_atomic

LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_FOLDER = re.compile(r"step_(\d{7})")
_STAGING_FOLDER = re.compile(r"\.tmp-step_\d{7}")


class CheckpointError(RuntimeError):
    """No checkpoint can be resumed from, or one does not fit the run; the message says which."""


def _name(step: int) -> str:
    return f"step_{step:07d}"


def save(
    root: Path,
    step: int,
    model: nn.Module,
    optimizers: tuple[Optimizer, ...],
    *,
    keep: int,
    warn: Callable[[str], None],
) -> Path:
    """Write model and optimizer state for ``step`` under ``root``; collective over all ranks.

    Once it is in place, rank 0 removes older checkpoints beyond the newest ``keep``
    (:func:`prune`, which passes its warnings to ``warn``) while the other ranks wait, so the
    next step never runs beside a half-removed folder.

    Raises:
        OSError: a write failed (e.g. ENOSPC, on any rank: DCP tells every rank); the staging
            folder is removed first, so a full disk leaves the earlier checkpoints as they were
            and no half-written one.
    """
    final = root / _name(step)
    staging = root / f".tmp-{_name(step)}"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizers),
        "step": step,
    }
    try:
        dcp.save(state, checkpoint_id=staging)
    except CheckpointException as exc:
        # Every rank removes it (ignoring the others' deletions): the first rank to report its
        # error makes the launcher stop the rest, which may not get to run this line.
        shutil.rmtree(staging, ignore_errors=True)
        raise _rank_error(exc) from exc
    dist.barrier()
    if dist.get_rank() == 0:
        try:
            _write_manifest(staging)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        write_text_atomic(root / LATEST, final.name)
        prune(root, keep, written=final, warn=warn)
    dist.barrier()
    return final


def _rank_error(exc: CheckpointException) -> Exception:
    """The first rank's own error inside DCP's wrapper, which is a BaseException whose text is
    every rank's traceback; an OSError keeps its errno (ENOSPC) and file name."""
    for error, _trace in exc.failures.values():
        if isinstance(error, Exception):
            return error
    return RuntimeError(f"saving the checkpoint failed on ranks {sorted(exc.failures)}")


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    entries = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in files
    }
    write_text_atomic(folder / MANIFEST, json.dumps({"files": entries}, indent=1))


def verify(folder: Path) -> str | None:
    """Why the checkpoint in ``folder`` cannot be loaded, or None when every file matches."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        # Written before manifests existed: DCP's own index is all there is to check.
        metadata = folder / ".metadata"
        return None if metadata.is_file() else f"{metadata} and {manifest} are missing"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{manifest} is unreadable"
    for name, expected in entries.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{path} has {size} bytes, {expected['bytes']} were written"
        if sha256_file(path) != expected["sha256"]:
            return f"{path} does not match its checksum"
    return None


def has_checkpoints(root: Path) -> bool:
    """Whether ``root`` holds any step folder (intact or not; :func:`latest` tells which loads)."""
    return root.is_dir() and any(_STEP_FOLDER.fullmatch(p.name) for p in root.iterdir())


def _step_folders(root: Path) -> list[Path]:
    """The step folders under ``root``, newest first (the zero-padded names sort by step)."""
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and _STEP_FOLDER.fullmatch(p.name)),
        key=lambda p: p.name,
        reverse=True,
    )


def latest(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` whose files match its manifest, or None.

    Newer checkpoints that fail :func:`verify` are skipped with a warning naming the file and the
    fault; the ``latest`` pointer is not trusted alone (its folder may be gone or damaged).
    """
    if not root.is_dir():
        return None
    skipped: list[str] = []
    for folder in _step_folders(root):
        fault = verify(folder)
        if fault is None:
            if skipped:
                warnings.warn(
                    f"resuming from {folder.name}; skipped newer damaged checkpoints: "
                    + "; ".join(skipped),
                    RuntimeWarning,
                    stacklevel=2,
                )
            return folder
        skipped.append(f"{folder.name}: {fault}")
    if skipped:
        raise CheckpointError(f"no checkpoint under {root} can be loaded: " + "; ".join(skipped))
    return None


def prune(root: Path, keep: int, *, written: Path, warn: Callable[[str], None]) -> None:
    """Remove the step folders under ``root`` older than the newest ``keep``, and the staging
    folders of crashed saves; rank 0, right after ``written`` was saved.

    What remains always holds the newest intact checkpoint: when the newest ``keep`` are all
    damaged (newer ones a resumed run skipped), the newest intact one below them stays as well,
    and ``warn`` receives a message naming each fault. ``written`` is intact by construction
    (its manifest was made from the files just written), so checkpoints are hashed only when
    ``keep`` or more step folders are newer than it; a run that saves in step order hashes
    nothing here.

    Nothing else is touched: files of the user's, other names, and step folders that are
    symlinks (not this run's to remove) stay. A folder that cannot be removed is passed to
    ``warn`` and the run goes on.

    Raises:
        ValueError: ``keep`` below 1 (the newest checkpoint is always kept).
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: at least 1 checkpoint is kept")
    folders = [p for p in _step_folders(root) if not p.is_symlink()]
    kept = {p.name for p in folders[:keep]}
    if written.name not in kept:
        intact, faults = _newest_intact(folders, written)
        if intact is not None and intact.name not in kept:
            kept.add(intact.name)
            warn(
                f"keeping {intact.name} beyond keep_checkpoints={keep}: it is the newest "
                "intact checkpoint and every newer one is damaged: " + "; ".join(faults)
            )
    doomed = [p for p in folders if p.name not in kept]
    doomed += [
        p
        for p in root.iterdir()
        if _STAGING_FOLDER.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    ]
    for folder in doomed:
        try:
            shutil.rmtree(folder)
        except OSError as exc:
            warn(f"could not remove old checkpoint {folder}: {exc}")


def _newest_intact(folders: list[Path], written: Path) -> tuple[Path | None, list[str]]:
    """The first of ``folders`` (newest first) that verifies, ``written`` counting as intact
    unhashed, and the faults of the damaged ones before it."""
    faults: list[str] = []
    for folder in folders:
        fault = None if folder.name == written.name else verify(folder)
        if fault is None:
            return folder, faults
        faults.append(f"{folder.name}: {fault}")
    return None, faults


def load(path: Path, model: nn.Module, optimizers: tuple[Optimizer, ...]) -> int:
    """Restore model and optimizer state in place (resharding as needed); return the step."""
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizers),
        "step": 0,
    }
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # DCP's wrapper is a BaseException
        lines = str(exc).splitlines() or [repr(exc)]
        first = next((line for line in lines if "size mismatch" in line.lower()), lines[-1])
        raise CheckpointError(
            f"{path} does not fit this model (was the model configuration changed since it was "
            f"written?): {first.strip()[:300]}"
        ) from exc
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizers, state["optim"])
    return int(state["step"])
