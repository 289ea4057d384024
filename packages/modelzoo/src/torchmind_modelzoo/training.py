"""``modelzoo train``: a full LLM card trained by hyperparallel (FSDP2/HSDP, Muon + AdamW).

The card names a transformers ``*ForCausalLM`` class; with ``--tiny`` its config class, given
the card's tiny overrides, is written as ``OUT/model/config.json`` and hyperparallel builds
random weights from it; with ``--path`` the local folder's weights (and tokenizer) are used.
The training itself is :func:`hyperparallel.train.job.run_job`, called in this process (it
spawns the ranks), not a ``hyperparallel`` subprocess. hyperparallel is the optional extra
``modelzoo[train]``; it never imports modelzoo.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from torchmind_modelzoo import registry
from torchmind_modelzoo.build import LibraryMissingError, model_class, tiny_overrides
from torchmind_modelzoo.checks import InputError, check_source
from torchmind_modelzoo.options import TrainOptions
from torchmind_modelzoo.schema import Category, ModelCard, Status


def trainable_cards() -> list[ModelCard]:
    """The full LLM cards (each names a transformers causal LM with a hyperparallel plan)."""
    return registry.list(Category.LLM, Status.FULL)


def check_trainable(card: ModelCard) -> None:
    """Only full LLM cards train.

    Raises:
        InputError: naming the card, why, and every trainable card.
    """
    if card.category is Category.LLM and card.status is Status.FULL:
        return
    kind = "a listed card" if card.status is not Status.FULL else f"a {card.category.value} card"
    names = ", ".join(c.id for c in trainable_cards())
    raise InputError(f"{card.id} is {kind}; modelzoo train takes the full LLM cards: {names}")


def _require_hyperparallel() -> None:
    if importlib.util.find_spec("hyperparallel") is None:
        raise LibraryMissingError(
            "modelzoo train needs hyperparallel: pip install 'torchmind-modelzoo[train]'"
        )


def write_tiny_config(card: ModelCard, folder: Path) -> Path:
    """The card's architecture with its tiny overrides as ``folder/config.json``; returns it."""
    cls: Any = model_class(card)  # a transformers *ForCausalLM (check_trainable)
    config = cls.config_class(**tiny_overrides(card))
    config.architectures = [card.architecture]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder / "config.json"


def train_config(card: ModelCard, options: TrainOptions, model: Path) -> Any:
    """hyperparallel's ``TrainConfig`` for ``card`` trained from ``model`` (a config.json or
    a model folder). Evaluation and the checkpoint come at the last step; warm-up is a tenth
    of the steps, so a 20-step run reaches its learning rate."""
    from hyperparallel.train.config import TrainConfig

    out = options.out_dir or Path("runs") / "train" / card.id
    return TrainConfig.model_validate(
        {
            "hf": {"source": str(model), "load_weights": not options.tiny},
            "data": {
                "path": None if options.data is None else str(options.data),
                "max_bytes": options.max_bytes,
                "seq_len": options.seq_len,
                "batch_size": options.batch_size,
            },
            "optim": {"warmup_steps": max(1, options.steps // 10)},
            "parallel": {"nproc": options.nproc, "mesh": options.mesh},
            "steps": options.steps,
            "eval_every": options.steps,
            "checkpoint_every": options.steps,
            "eval_batches": 2,
            "out_dir": str(out),
            "seed": options.seed,
        }
    )


def train(
    card: ModelCard,
    options: TrainOptions,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``card`` with hyperparallel; a JSON-friendly summary of the run.

    Raises:
        InputError: a card that does not train, a wrong weight source, or a setting
            hyperparallel refuses (the message is hyperparallel's one line).
        LibraryMissingError: hyperparallel or transformers is not installed.
    """
    check_trainable(card)
    check_source(card, tiny=options.tiny, path=options.path)
    _require_hyperparallel()
    from hyperparallel.train import job
    from hyperparallel.train.checkpoint import CheckpointError

    out = options.out_dir or Path("runs") / "train" / card.id
    options = options.model_copy(update={"out_dir": out})
    if options.tiny:
        model = _tiny_model(card, out, resume=resume, overwrite=overwrite)
    else:
        model = Path(options.path or "")
    cfg = train_config(card, options, model)
    started = time.perf_counter()
    try:
        job.prepare(cfg, resume=resume, overwrite=overwrite)
        results = job.start(cfg, resume=resume, progress=progress)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        raise InputError(str(exc)) from None
    first = results[0]
    return {
        "card": card.id,
        "architecture": card.architecture,
        "model": str(model),
        "tiny": options.tiny,
        "nproc": options.nproc,
        "mesh": options.mesh,
        "steps": [first.first_step, first.last_step],
        "losses": first.train_losses,
        "val_loss": first.val_losses[-1] if first.val_losses else None,
        "seconds": round(time.perf_counter() - started, 3),
        "out_dir": str(out),
    }


def _tiny_model(card: ModelCard, out: Path, *, resume: bool, overwrite: bool) -> Path:
    """Where the tiny config goes (``OUT/model``). It is written before the checks (they read
    it) only into a new folder or one this command is allowed to change; an earlier run's
    folder without --resume/--overwrite is left for hyperparallel to refuse untouched."""
    folder = out / "model"
    if not (folder / "config.json").exists() or resume or overwrite:
        try:
            write_tiny_config(card, folder)
        except OSError as exc:
            raise InputError(
                f"--out-dir {out}: cannot write {folder / 'config.json'} ({exc.strerror or exc})"
            ) from None
    return folder / "config.json"
