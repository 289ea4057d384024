"""What a job wrote into its output folder, so that replacing the run removes exactly that.

Output folders are the user's: they pick them, and they keep their own notes, profiles and
scripts beside a run. A job that decides "this folder holds a run" from file names alone calls
the user's ``profile/`` folder a run, and ``--overwrite`` then deletes it. So every job records
the entries it creates in a small file in the folder (:data:`RECORD_NAME`) before it creates
them; only recorded entries make the folder a run, only they are removed, and a symlink among
them is unlinked, never followed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from npu_core.files import write_text_atomic

RECORD_NAME = ".run-record.json"
"""The record's file name in the output folder (hidden: it is bookkeeping, not a result)."""


class RunRecord:
    """The entries (top-level files and folders) a job created in ``folder``.

    Args:
        folder: the job's output folder; it need not exist yet.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.path = self.folder / RECORD_NAME

    def recorded(self) -> list[str]:
        """Names in the record, in the order they were claimed (empty without a record).

        A record that cannot be read (damaged, not JSON) counts as empty: then nothing is
        removed on its account, which is the safe side.
        """
        try:
            names = json.loads(self.path.read_text(encoding="utf-8"))["entries"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [n for n in names if isinstance(n, str) and _is_plain_name(n)]

    def present(self) -> list[str]:
        """Recorded entries that exist now: what makes the folder hold a run."""
        return [n for n in self.recorded() if os.path.lexists(self.folder / n)]

    def foreign(self, names: list[str] | tuple[str, ...]) -> list[str]:
        """Of the entries a job is about to create, those that exist but it did not record.

        They belong to someone else (the user, another tool): writing over them would lose
        them, and removing them is not the job's call, so the job must refuse the folder.
        """
        ours = set(self.recorded())
        return [n for n in names if n not in ours and os.path.lexists(self.folder / n)]

    def claim(self, names: list[str] | tuple[str, ...]) -> None:
        """Record ``names`` as this job's before it creates them (creates ``folder``)."""
        for name in names:
            if not _is_plain_name(name):
                raise ValueError(f"a recorded entry must be a plain name, got {name!r}")
        entries = list(dict.fromkeys([*self.recorded(), *names]))
        self.folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps({"entries": entries}, indent=2) + "\n")

    def remove(self) -> list[str]:
        """Delete the recorded entries that exist, then the record; return what was deleted.

        A recorded name that is now a symlink is unlinked: its target is not the job's.
        """
        removed = []
        for name in self.present():
            path = self.folder / name
            if path.is_symlink() or not path.is_dir():
                path.unlink()
            else:
                shutil.rmtree(path)
            removed.append(name)
        self.path.unlink(missing_ok=True)
        return removed


def _is_plain_name(name: str) -> bool:
    """One path component, not ``.``/``..``: a record can never point outside its folder."""
    return bool(name) and name not in (".", "..") and Path(name).name == name and "/" not in name
