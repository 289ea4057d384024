"""``modelzoo train``: a full LLM card trained by hyperparallel (FSDP2/HSDP, Muon + AdamW).

The card names a transformers ``*ForCausalLM`` class; with ``--tiny`` its config class, given
the card's tiny overrides, is written as ``OUT/model/config.json`` and hyperparallel builds
random weights from it; with ``--path`` the local folder's weights (and tokenizer) are used.
The run is configured in hyperparallel's own ``TrainConfig`` sections (:func:`job_tree`), so
``--set data.global_batch_size=8`` means what it means to ``hyperparallel train``. The training
itself is hyperparallel's ``train.job`` (prepare, then start), called in this process (it spawns
the ranks), not a ``hyperparallel`` subprocess. hyperparallel is the optional extra
``modelzoo[train]``; it never imports modelzoo.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from npu_core.config import ConfigError, merge, set_dotted
from torchmind_modelzoo import registry
from torchmind_modelzoo.build import LibraryMissingError, model_class, tiny_overrides
from torchmind_modelzoo.checks import InputError, check_source
from torchmind_modelzoo.options import JOB_DEFAULTS, TrainOptions
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


def job_tree(card: ModelCard, options: TrainOptions) -> dict[str, Any]:
    """The run's TrainConfig values before validation: hyperparallel's defaults changed by
    :data:`JOB_DEFAULTS` and the card's out-dir (``runs/train/<card>``), then ``options.job``
    section by section. Evaluation and the checkpoint come at the last step and warm-up is a
    tenth of the steps (a 20-step run reaches its learning rate), unless ``options.job`` sets
    them.

    Raises:
        InputError: ``options.job`` sets the model (``hf.source``, ``hf.load_weights``), which a
            card run takes from the card or ``--path``.
    """
    hf = options.job.get("hf")
    for key in ("source", "load_weights"):
        if isinstance(hf, dict) and key in hf:
            raise InputError(
                f"hf.{key}={hf[key]!r}: a card run trains the card's model (--tiny) or --path "
                "DIR; leave hf.source and hf.load_weights out"
            )
    tree = copy.deepcopy(JOB_DEFAULTS)
    tree["out_dir"] = str(Path("runs") / "train" / card.id)
    merge(tree, copy.deepcopy(options.job))
    steps = tree["steps"]
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:  # else refused
        derived = {"eval_every": steps, "checkpoint_every": steps}
        derived["optim.warmup_steps"] = max(1, steps // 10)
        for key, value in derived.items():
            if not _has_key(tree, key):
                _set_key(tree, key, value)
    return tree


def train_config(card: ModelCard, options: TrainOptions, model: Path) -> Any:
    """hyperparallel's ``TrainConfig`` for ``card`` trained from ``model`` (a config.json or a
    model folder): :func:`job_tree` with the model set, validated by ``TrainConfig`` itself.

    Raises:
        InputError: one line naming the key, its value and what is allowed.
    """
    from hyperparallel.train.config import TrainConfig

    tree = job_tree(card, options)
    _set_key(tree, "hf.source", str(model))
    _set_key(tree, "hf.load_weights", not options.tiny)
    unknown = _unknown_setting(TrainConfig, tree)
    if unknown is not None:
        raise InputError(unknown)
    try:
        return TrainConfig.validate_tree(tree)
    except ConfigError as exc:
        raise InputError(str(exc)) from None


def _has_key(tree: dict[str, Any], dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    try:
        set_dotted(tree, dotted, value)
    except ConfigError as exc:
        raise InputError(str(exc).replace("--set ", "", 1)) from None


def _unknown_setting(model: type[BaseModel], tree: dict[str, Any], prefix: str = "") -> str | None:
    """``key=value: ...; choose one of ...`` for the first key ``model`` lacks, else None.

    TrainConfig refuses such a key too, but without naming what the section does have.
    """
    for key, value in tree.items():
        field = model.model_fields.get(key)
        if field is None:
            where = f"section {prefix[:-1]}" if prefix else "TrainConfig"
            return (
                f"{prefix}{key}={value!r}: hyperparallel's {where} has no such setting; choose "
                f"one of {', '.join(model.model_fields)}"
            )
        section = field.annotation
        if isinstance(value, dict) and isinstance(section, type) and issubclass(section, BaseModel):
            found = _unknown_setting(section, value, f"{prefix}{key}.")
            if found is not None:
                return found
    return None


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

    out = Path(str(job_tree(card, options)["out_dir"]))
    model = out / "model" / "config.json" if options.tiny else Path(options.path or "")
    cfg = train_config(card, options, model)  # every setting checked before a file is written
    if options.tiny:
        _write_tiny_model(card, model.parent, resume=resume, overwrite=overwrite)
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
        "nproc": cfg.parallel.nproc,
        "mesh": cfg.parallel.mesh,
        "steps": [first.first_step, first.last_step],
        "losses": first.train_losses,
        "val_loss": first.val_losses[-1] if first.val_losses else None,
        "seconds": round(time.perf_counter() - started, 3),
        "out_dir": str(out),
    }


def _write_tiny_model(card: ModelCard, folder: Path, *, resume: bool, overwrite: bool) -> None:
    """The tiny config in ``folder`` (``OUT/model``). It is written before hyperparallel's checks
    (they read it) only into a new folder or one this command is allowed to change; an earlier
    run's folder without --resume/--overwrite is left for hyperparallel to refuse untouched."""
    if not (folder / "config.json").exists() or resume or overwrite:
        try:
            write_tiny_config(card, folder)
        except OSError as exc:
            raise InputError(
                f"out_dir {folder.parent}: cannot write {folder / 'config.json'} "
                f"({exc.strerror or exc})"
            ) from None
