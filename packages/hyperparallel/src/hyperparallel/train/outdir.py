"""The run folder: refuse to mix a new run into an old one, and fail before training if the folder
cannot be written.

Writing a new run into a folder that holds an earlier one silently mixes them: metrics.json is
replaced by a shorter history, step folders of both runs sit side by side and ``latest`` moves
back. So an existing run is kept unless the user says ``--resume`` (continue it) or
``--overwrite`` (remove it first). Checked before any rank starts, so the answer costs nothing.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

RUN_ARTEFACTS = ("metrics.json", "loss.png", "checkpoints", "profile")
"""What ``hyperparallel train`` writes into its out-dir; only these are removed by --overwrite."""


def previous_run(out_dir: Path) -> list[str]:
    """The run artefacts already in ``out_dir`` (empty when it holds no run or does not exist)."""
    return [name for name in RUN_ARTEFACTS if (out_dir / name).exists()]


def prepare_out_dir(out_dir: Path, *, resume: bool, overwrite: bool, remove: bool = True) -> None:
    """Make ``out_dir`` ready for a run, or raise ValueError saying why it is not.

    Args:
        out_dir: The run folder.
        resume: The run continues the one in ``out_dir``.
        overwrite: An earlier run in ``out_dir`` is to be replaced.
        remove: Whether this process deletes the earlier run's artefacts on ``overwrite`` (one
            process of a torchrun job, so that ranks do not race to delete the same files).

    Raises:
        ValueError: both flags, an earlier run without either flag, or a folder that cannot be
            created or written.
    """
    if resume and overwrite:
        raise ValueError(
            "--resume and --overwrite exclude each other: --resume continues the run in "
            f"{out_dir}, --overwrite deletes it"
        )
    found = previous_run(out_dir)
    if found and not (resume or overwrite):
        raise ValueError(
            f"--out-dir {out_dir} already holds a run ({', '.join(found)}); pass --resume to "
            "continue it, --overwrite to replace it, or choose another --out-dir"
        )
    if found and overwrite and remove:
        for name in found:
            path = out_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    _check_writable(out_dir)


def _check_writable(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ValueError(
            f"--out-dir {out_dir} cannot be written ({exc.strerror or exc}); choose a folder "
            "you can write to"
        ) from None
