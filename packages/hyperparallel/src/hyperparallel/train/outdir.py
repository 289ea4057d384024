"""The run folder: refuse to mix a new run into an old one or into the user's files, and refuse a
folder that cannot be written, before anything is written.

Writing a new run into a folder that holds an earlier one silently mixes them: metrics.json is
replaced by a shorter history, step folders of both runs sit side by side and ``latest`` moves
back. So an earlier run is kept unless the user says ``--resume`` (continue it) or
``--overwrite`` (remove it first). What counts as "the earlier run" is what the job recorded
writing (:class:`npu_core.run_record.RunRecord`), never a guess from names: a folder the user
keeps beside the run is neither a reason to refuse nor ever removed, and a recorded entry that
is now a symlink is unlinked, not followed.

Folders written before run records existed have no record. ``--resume`` of such a folder claims
the artefacts it finds (they are the run being continued); ``--overwrite`` cannot tell them
from the user's files and refuses, naming them.
"""

from __future__ import annotations

from pathlib import Path

from hyperparallel.train.config import TrainConfig
from npu_core.files import check_writable_folder
from npu_core.run_record import RunRecord

RUN_ARTEFACTS = ("metrics.json", "loss.png", "checkpoints", "logs")
"""What every ``hyperparallel train`` run may write into its out-dir (``logs`` holds a failed
rank's traceback); ``profile`` is added when the run traces steps."""

PROFILE = "profile"


def run_artefacts(cfg: TrainConfig) -> tuple[str, ...]:
    """The entries the run configured by ``cfg`` may create in its out-dir."""
    return (*RUN_ARTEFACTS, PROFILE) if cfg.profile_steps else RUN_ARTEFACTS


def prepare_out_dir(
    out_dir: Path,
    artefacts: tuple[str, ...] = RUN_ARTEFACTS,
    *,
    resume: bool,
    overwrite: bool,
    owner: bool = True,
) -> None:
    """Check ``out_dir`` for a run, then (as ``owner``) remove an earlier run on ``overwrite``
    and record ``artefacts`` as this run's; or raise ValueError saying why the folder is refused.

    Every check comes first: a refused folder is left exactly as it was (not even created).

    Args:
        out_dir: The run folder.
        artefacts: The entries this run may create (:func:`run_artefacts`).
        resume: The run continues the one in ``out_dir``.
        overwrite: An earlier run in ``out_dir`` is to be replaced.
        owner: Whether this process changes the folder (one process of a torchrun job, so that
            ranks do not race to remove and record the same entries); the others only check.

    Raises:
        ValueError: both flags, an earlier run without either flag, entries this run would
            write into that it did not create, or a folder that cannot be written.
    """
    if resume and overwrite:
        raise ValueError(
            "--resume and --overwrite exclude each other: --resume continues the run in "
            f"{out_dir}, --overwrite deletes it"
        )
    try:
        check_writable_folder(out_dir)
    except ValueError as exc:
        raise ValueError(f"--out-dir {exc}; choose a folder you can write to") from None
    record = RunRecord(out_dir)
    unrecorded = not record.path.exists()
    found = record.present()
    if found and not (resume or overwrite):
        raise ValueError(
            f"--out-dir {out_dir} already holds a run ({', '.join(found)}); pass --resume to "
            "continue it, --overwrite to replace it, or choose another --out-dir"
        )
    foreign = [] if resume and unrecorded else record.foreign(artefacts)
    if foreign:
        raise ValueError(_foreign_message(out_dir, foreign, unrecorded, overwrite))
    if not owner:
        return
    if overwrite:
        record.remove()
    record.claim(artefacts)


def _foreign_message(out_dir: Path, foreign: list[str], unrecorded: bool, overwrite: bool) -> str:
    names = ", ".join(foreign)
    if unrecorded and ({"metrics.json", "checkpoints"} & set(foreign)):
        # Most likely a run written before run records: only --resume can take it over.
        fix = (
            "--overwrite removes only what a run recorded writing, so remove them yourself, "
            "pass --resume to continue that run"
            if overwrite
            else "pass --resume to continue that run, remove them"
        )
        return (
            f"--out-dir {out_dir} holds {names}, which no recorded run wrote (a run of an "
            f"earlier version, or files of your own); {fix}, or choose another --out-dir"
        )
    return (
        f"--out-dir {out_dir} holds {names}, which this run would write into but did not "
        "create; move them away or choose another --out-dir"
    )
