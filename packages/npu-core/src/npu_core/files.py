"""Files that are complete or absent: write under a temporary name, then rename into place.

A crash, a full disk or a kill while writing must never leave a result, checkpoint manifest or
artefact that looks complete but is not. Every package writes its outputs through here, so they
also get the permissions ordinary files get: ``tempfile.mkstemp`` creates files readable by
their owner only (0600), which would make a run's metrics.json unreadable to the user's group.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _ordinary_file_mode() -> int:
    """0666 minus the process umask: the mode ``open(path, "w")`` would have given."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it becomes ``path`` in one rename.

    The caller writes the temporary file by any means (a library's ``save(tmp)``, ``open``).
    On an exception the temporary file is removed and ``path`` is untouched. The suffix is kept
    (``.png``, ``.mp4``) so that writers that pick a format from it still do.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _ordinary_file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically; return the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks (checkpoint shards do not fit in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class UnwritableFolderError(ValueError):
    """A folder meant for outputs is a file, or cannot be created or written here."""


def check_writable_folder(path: str | os.PathLike[str]) -> None:
    """Raise :class:`UnwritableFolderError` unless outputs can be written into ``path``.

    Run before any work, so that a run that cannot keep its results is refused at once instead
    of failing at the end. Creates nothing: a missing folder is judged by the nearest existing
    folder above it, where a probe file is created and removed again. The message starts with
    the path; callers put the option's name in front (``--out /proc/x: ...``).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UnwritableFolderError(f"{path} is a file; expected a folder for the outputs")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UnwritableFolderError(f"{path} cannot be created: {existing} is a file")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-probe-")
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UnwritableFolderError(
            f"{path} is not writable (creating a file in {existing} failed: {reason})"
        ) from None
    os.close(fd)
    os.unlink(probe)
