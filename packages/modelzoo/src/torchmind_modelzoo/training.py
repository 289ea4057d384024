"""``modelzoo train``: a full LLM card trained by hyperparallel (FSDP2/HSDP, Muon + AdamW).

The card names a transformers ``*ForCausalLM`` class; with ``--tiny`` its config class, given
the card's tiny overrides, is written as ``OUT/model/config.json`` and hyperparallel builds
random weights from it; ``--full-size`` does the same with the card's published config (bytes
as tokens: no card ships a tokenizer); with ``--path`` the local folder's weights (and
tokenizer) are used.
The run is configured in hyperparallel's own ``TrainConfig`` sections (:func:`job_tree`), so
``--set data.global_batch_size=8`` means what it means to ``hyperparallel train``. The training
itself is hyperparallel's ``train.job`` (its checks, then start), called in this process (it
spawns the ranks), not a ``hyperparallel`` subprocess: :func:`prepare` checks everything and
readies the out-dir, :func:`start` trains. hyperparallel is the optional extra
``modelzoo[train]``; it never imports modelzoo.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npu_core.config import ConfigError, merge, set_dotted
from npu_core.dist import is_torchrun
from npu_core.env import launch_rank
from npu_core.files import write_text_atomic
from torchmind_modelzoo import registry
from torchmind_modelzoo.build import LibraryMissingError, model_class
from torchmind_modelzoo.checks import InputError
from torchmind_modelzoo.model_shape import check_model_source, config_values
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


def write_model_config(card: ModelCard, options: TrainOptions, folder: Path) -> Path:
    """The card's architecture in the shape ``options`` choose (tiny, or published with
    ``--layers``; :func:`~torchmind_modelzoo.model_shape.config_values`) as
    ``folder/config.json``; returns it."""
    cls: Any = model_class(card)  # a transformers *ForCausalLM (check_trainable)
    config = cls.config_class(**config_values(card, options))
    config.architectures = [card.architecture]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder / "config.json"


def write_tiny_config(card: ModelCard, folder: Path) -> Path:
    """The card's architecture with its tiny overrides as ``folder/config.json``; returns it."""
    return write_model_config(card, TrainOptions(tiny=True), folder)


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
                f"hf.{key}={hf[key]!r}: a card run trains the card's model (--tiny, "
                "--full-size) or --path DIR; leave hf.source and hf.load_weights out"
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
    _set_key(tree, "hf.load_weights", not options.random_weights)
    try:  # an unknown key's line lists the fields of its section (npu_core.config)
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


MODEL = "model"
"""The out-dir entry holding a ``--tiny`` or ``--full-size`` run's ``config.json`` (recorded as
the run's own)."""

Warn = Callable[[str], None]


@dataclass(frozen=True)
class PreparedRun:
    """A card run that passed every check, its out-dir ready: what :func:`start` launches.

    Attributes:
        card: the card being trained.
        config: hyperparallel's validated ``TrainConfig`` (``hf.source`` is :attr:`model`).
        model: the trained model's ``config.json`` (``--tiny``, ``--full-size``) or folder
            (``--path``).
        resume: whether the run continues the one in its out-dir.
        full_size: whether the model is the card's published shape (``--full-size``).
    """

    card: ModelCard
    config: Any
    model: Path
    resume: bool
    full_size: bool = False

    @property
    def out_dir(self) -> Path:
        """The run folder (metrics, plot, checkpoints, the failed ranks' ``logs``)."""
        return Path(self.config.out_dir)


def prepare(
    card: ModelCard,
    options: TrainOptions,
    *,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
    warn: Warn | None = None,
) -> PreparedRun:
    """Check everything hyperparallel's job checks, then ready the out-dir; nothing is written
    before the last check has passed.

    With ``--tiny`` or ``--full-size`` the model's config.json is the run's own file in the
    out-dir, but the checks
    need it to read the model: a new run's is built in a temporary folder outside the out-dir,
    checked there, and written into the out-dir only afterwards. A resumed run keeps the
    config.json it was trained with.

    Args:
        allow_config_change: with ``resume``, accept model or data settings that differ from
            the run's.
        warn: receives each of the job's warnings (on rank 0 only, under torchrun).

    Raises:
        InputError: a card that does not train, a wrong weight source, a setting or an out-dir
            hyperparallel refuses (the message is hyperparallel's one line).
        LibraryMissingError: hyperparallel or transformers is not installed.
    """
    check_trainable(card)
    check_model_source(card, options)
    _require_hyperparallel()
    out = Path(str(job_tree(card, options)["out_dir"]))
    checks = {"resume": resume, "overwrite": overwrite, "allow_config_change": allow_config_change}
    built = options.random_weights
    model = out / MODEL / "config.json" if built else Path(options.path or "")
    entries = (MODEL,) if built else ()
    if built and not (resume and not overwrite):  # a new run: its model is built here
        with tempfile.TemporaryDirectory(prefix="modelzoo-model-") as staging:
            staged = write_model_config(card, options, Path(staging))
            staged_cfg = train_config(card, options, staged)
            if options.full_size:
                _check_host_memory(card, options, staged, staged_cfg)
            messages = _check_job(staged_cfg, checks, shown={str(staged): str(model)})
            cfg = train_config(card, options, model)
            _prepare_out_dir(cfg, entries, checks)
            _install(staged, model)
    else:
        if built and not model.is_file():
            flag = "--full-size" if options.full_size else "--tiny"
            raise InputError(
                f"--resume: {out} holds no {flag} run to continue ({model} is missing); run "
                "without --resume to start a new run"
            )
        cfg = train_config(card, options, model)
        messages = _check_job(cfg, checks)
        _prepare_out_dir(cfg, entries, checks)
    if warn is not None and launch_rank() == 0:
        for message in messages:
            warn(message)
    return PreparedRun(
        card=card, config=cfg, model=model, resume=resume, full_size=options.full_size
    )


def _check_host_memory(card: ModelCard, options: TrainOptions, config_json: Path, cfg: Any) -> None:
    """A published-size model must fit the machine once per local rank in the run's parameter
    dtype (every rank builds it whole before sharding): counted on the meta device, refused
    before any rank starts, naming --layers as the way to keep its proportions in less
    memory."""
    import torch
    import transformers

    from hyperparallel.train.memory import check_host_memory

    config = transformers.AutoConfig.from_pretrained(config_json.parent, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    ranks = 1 if is_torchrun() else cfg.parallel.nproc
    layers = f", --layers {options.layers}" if options.layers is not None else ""
    try:
        check_host_memory(parameters, ranks, f"{card.id} (--full-size{layers})", dtype=cfg.dtype)
    except ValueError as exc:
        hint = "" if cfg.dtype == "bf16" else ", --set dtype=bf16 to halve it"
        raise InputError(
            f"{exc}, or --layers N to keep N layers at the published width{hint}"
        ) from None


def _check_job(cfg: Any, checks: dict[str, bool], shown: dict[str, str] | None = None) -> list[str]:
    """hyperparallel's checks of ``cfg`` (model, mesh, memory, data, resume); its warnings.

    ``shown`` maps the staged model's path to the one it will have, so that a refusal names
    the file the user will find.
    """
    from hyperparallel.train import job
    from hyperparallel.train.checkpoint import CheckpointError

    def named(text: str) -> str:
        for staged, final in (shown or {}).items():
            text = text.replace(staged, final)
        return text

    try:
        return [named(m) for m in job.check(cfg, **checks)]
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        raise InputError(named(str(exc))) from None


def _prepare_out_dir(cfg: Any, entries: tuple[str, ...], checks: dict[str, bool]) -> None:
    """hyperparallel's out-dir preparation, with ``entries`` (the ``model`` folder) recorded as
    the run's too: refused when the user keeps a folder of that name there, removed with the
    rest of an earlier run on ``--overwrite``. Under torchrun only rank 0 changes the folder."""
    from hyperparallel.train.outdir import prepare_out_dir, run_artefacts

    try:
        prepare_out_dir(
            Path(cfg.out_dir),
            (*run_artefacts(cfg), *entries),
            resume=checks["resume"],
            overwrite=checks["overwrite"],
            owner=launch_rank() == 0,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _install(staged: Path, model: Path) -> None:
    """Write the checked ``staged`` config.json as ``model``, complete or not at all."""
    try:
        write_text_atomic(model, staged.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(
            f"out_dir {model.parent.parent}: cannot write {model} ({exc.strerror or exc})"
        ) from None


def start(run: PreparedRun, *, progress: bool = True) -> dict[str, Any]:
    """Train a :func:`prepare`-d run on its ranks; a JSON-friendly summary of the run.

    Raises:
        InputError: the checkpoint to resume from does not fit the model.
        Exception: what a failed rank raised (``npu_core.cli.rank_failures`` turns it into
            one line naming the rank).
    """
    from hyperparallel.train import job
    from hyperparallel.train.checkpoint import CheckpointError

    cfg = run.config
    started = time.perf_counter()
    try:
        results = job.start(cfg, resume=run.resume, progress=progress)
    except CheckpointError as exc:
        raise InputError(str(exc)) from None
    first = results[0]
    return {
        "card": run.card.id,
        "architecture": run.card.architecture,
        "model": str(run.model),
        "tiny": not cfg.hf.load_weights and not run.full_size,
        "full_size": run.full_size,
        "nproc": cfg.parallel.nproc,
        "mesh": cfg.parallel.mesh,
        "steps": [first.first_step, first.last_step],
        "losses": first.train_losses,
        "val_loss": first.val_losses[-1] if first.val_losses else None,
        "step_medians": step_medians(run.out_dir / "metrics.json", first.first_step),
        "seconds": round(time.perf_counter() - started, 3),
        "out_dir": str(run.out_dir),
    }


STEP_MEDIAN_KEYS = ("tokens_per_s", "backward_ms", "optim_ms")
"""The step records of metrics.json that the summary gives as medians."""


def step_medians(metrics: Path, first_step: int) -> dict[str, Any]:
    """Medians of this run's step records after its first step (which pays for warming caches
    and building communicators), from rank 0's ``metrics.json``: tokens/s, forward + backward
    ms (``backward_ms``), optimizer ms, and each rank's peak memory in MiB (the device's peak
    allocated memory, on CPU the rank process's peak resident set).

    Args:
        metrics: the run's ``metrics.json``.
        first_step: the step the run started from (0, or the resumed checkpoint's).
    """
    records = [r for r in json.loads(metrics.read_text())["train"] if r["step"] > first_step]
    timed = records[1:] or records
    if not timed:
        return {}
    medians: dict[str, Any] = {"steps": f"{timed[0]['step']}-{timed[-1]['step']}"}
    for key in STEP_MEDIAN_KEYS:
        medians[key] = round(statistics.median(r[key] for r in timed), 1)
    ranks = zip(*(r["peak_memory_mb"] for r in timed), strict=True)
    medians["peak_memory_mb"] = [round(statistics.median(rank), 1) for rank in ranks]
    return medians


def train(
    card: ModelCard,
    options: TrainOptions,
    *,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
    progress: bool = True,
    warn: Warn | None = None,
) -> dict[str, Any]:
    """Train ``card`` with hyperparallel (:func:`prepare`, then :func:`start`); the summary.

    Raises:
        InputError: a card that does not train, a wrong weight source, a setting or out-dir
            hyperparallel refuses, or a checkpoint that does not fit.
        LibraryMissingError: hyperparallel or transformers is not installed.
    """
    run = prepare(
        card,
        options,
        resume=resume,
        overwrite=overwrite,
        allow_config_change=allow_config_change,
        warn=warn,
    )
    return start(run, progress=progress)
