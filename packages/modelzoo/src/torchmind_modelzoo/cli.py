"""``modelzoo``: list, show and validate model cards; convert, run and train the full ones.

Listing and validation need neither transformers nor diffusers; convert and run import the
card's library when they need it and say which extra to install when it is missing.

Exit status: 0 done; 1 the work failed (an invalid card, a missing library, a failed rank,
one line naming it); 2 the input was refused before any work started (one line on stderr
naming the argument; nothing written).
"""

import enum
import json
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from npu_core.cli import HelpGroup, config_options, fail, rank_failures, run_app
from npu_core.config import ConfigError, layer_tree, set_dotted
from torchmind_modelzoo import registry
from torchmind_modelzoo.checks import InputError, check_card_file, check_source
from torchmind_modelzoo.options import (
    JOB_DEFAULTS,
    JOB_FLAGS,
    ConvertOptions,
    RunOptions,
    TrainOptions,
)
from torchmind_modelzoo.schema import Category, ModelCard, Status
from torchmind_modelzoo.table import render_markdown, update_readme
from torchmind_modelzoo.validate import CardError

app = typer.Typer(
    cls=HelpGroup,
    help="Model cards for 100 current models; convert and run the 'full' ones.\n\n"
    "Start with `modelzoo list --status full`, then `modelzoo run qwen3-0.6b --tiny` (random "
    "weights, offline) or `--path DIR` for weights you downloaded. Nothing is ever fetched.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
_TRAIN_FIELDS = TrainOptions.model_fields


class Format(enum.StrEnum):
    TABLE = "table"
    JSON = "json"
    MARKDOWN = "markdown"


def _exit_code(exc: Exception) -> int:
    """2 for input refused before any work (:class:`InputError`), 1 for work that failed."""
    return 2 if isinstance(exc, InputError) else 1


def _card(name: str) -> ModelCard:
    try:
        return registry.get(name)
    except KeyError as exc:
        fail(str(exc.args[0]))


@app.command("list")
def list_cards(
    category: Annotated[Category | None, typer.Option(help="Keep one category.")] = None,
    status: Annotated[Status | None, typer.Option(help="Keep 'full' or 'listed' cards.")] = None,
    format: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.TABLE,
    readme: Annotated[
        Path | None,
        typer.Option(help="With --format markdown: rewrite the support table in this README."),
    ] = None,
) -> None:
    """List the cards (sorted by category, then id)."""
    cards = registry.list(category, status)
    if format is Format.JSON:
        print(json.dumps([c.summary() for c in cards], indent=2))
    elif format is Format.MARKDOWN:
        table = render_markdown(cards)
        if readme is None:
            print(table, end="")
        else:
            changed = update_readme(readme, table)
            console.print(f"{readme}: {'updated' if changed else 'already current'}")
    else:
        out = Table(title=f"{len(cards)} model cards")
        for column in ("id", "category", "architecture", "params (B)", "status"):
            out.add_column(column)
        for c in cards:
            out.add_row(c.id, c.category.value, c.architecture, f"{c.params_b:g}", c.status.value)
        console.print(out)


@app.command()
def show(name: Annotated[str, typer.Argument(help="Card id, e.g. qwen3-0.6b.")]) -> None:
    """Print one card as YAML, with the file it was read from."""
    card = _card(name)
    print(f"# {registry.source_of(name)}")
    print(yaml.safe_dump(card.model_dump(mode="json", exclude_none=True), sort_keys=False), end="")


@app.command()
def validate(
    files: Annotated[
        list[Path] | None, typer.Argument(help="Extra card files to check (out-of-tree cards).")
    ] = None,
) -> None:
    """Validate every shipped card (schema + architecture class in the installed library)."""
    try:
        paths = [check_card_file(f) for f in files or []]  # all of them, before any is read
    except InputError as exc:
        fail(str(exc), code=_exit_code(exc))
    try:
        cards = registry.list()
        extra = [registry.register(f, replace=True) for f in paths]
        skipped = registry.validate_all([*cards, *extra])
    except CardError as exc:
        fail(f"invalid card: {exc}", code=1)
    reasons = {k: v for k, v in skipped.items() if v}
    checked = len(skipped) - len(reasons)
    console.print(f"{len(skipped)} cards valid; library class checked for {checked}")
    for name, reason in sorted(reasons.items()):
        console.print(f"  [yellow]skipped[/yellow] {name}: {escape(reason)}")


@app.command()
@config_options(ConvertOptions)
def convert(
    name: Annotated[str, typer.Argument(help="Card id of a full card.")],
    config: ConvertOptions,
) -> None:
    """Convert a full card's model (torch.export .pt2 or safetensors) and write a manifest.

    The exported program is checked against eager on the example inputs and on a second shape
    before it is written, e.g. `modelzoo convert qwen3-8b --tiny --out out/qwen3`. --out must
    be new or empty, or hold a previous conversion and --overwrite be given.
    """
    from torchmind_modelzoo.build import LibraryMissingError
    from torchmind_modelzoo.convert import convert as run_convert

    card = _card(name)
    if config.out is None:
        fail("--out is required: the folder for the artefact and manifest")
    settings = config.model_dump()
    try:
        with console.status(f"converting {name}"):
            manifest = run_convert(card, settings.pop("out"), **settings)
    except (LibraryMissingError, FileNotFoundError, ValueError) as exc:
        fail(str(exc), code=_exit_code(exc))
    console.print(json.dumps(manifest, indent=2, default=str))


def _rank_run(card: ModelCard, kwargs: dict) -> dict:
    """One rank of ``run --nproc N`` (module level, so the launcher can pickle it)."""
    from torchmind_modelzoo.runner import run as run_example

    return run_example(card, **kwargs)


@app.command()
@config_options(RunOptions)
def run(
    name: Annotated[str, typer.Argument(help="Card id of a full card.")],
    config: RunOptions,
) -> None:
    """Run a full card's inference example and print its result as JSON.

    e.g. `modelzoo run wan2.1-t2v-1.3b --tiny --nproc 2` (liteboost Ulysses over 2 ranks) or
    `modelzoo run qwen3-8b --path ./Qwen3-8B --prompt "Hello"` (real weights, local files only).
    """
    card = _card(name)
    kwargs = config.model_dump(exclude={"nproc"})
    kwargs["path"] = None if config.path is None else str(config.path)
    from torchmind_modelzoo.build import LibraryMissingError

    try:
        # Checked here as well as in each rank, so that a bad input starts no rank.
        if card.example is None or card.convert is None:
            raise InputError(f"{card.id} is a listed card: it has no runnable example")
        check_source(card, tiny=config.tiny, path=config.path)
        if config.nproc > 1:
            from npu_core.dist import launch

            results = launch(_rank_run, config.nproc, card, kwargs, timeout=1800.0)
            result = {**results[0], "nproc": config.nproc}
        else:
            from torchmind_modelzoo.runner import run as run_example

            with console.status(f"running {name}"):
                result = run_example(card, **kwargs)
    except (LibraryMissingError, FileNotFoundError, ValueError) as exc:
        fail(str(exc), code=_exit_code(exc))
    print(json.dumps(result, indent=2, default=str))


def _job_option(key: str, help: str, default: object = None) -> Any:
    """A shortcut option for the TrainConfig key ``key``; given, it wins over --config and --set.
    ``default``: what the help shows when the card run's defaults (JOB_DEFAULTS) lack the key."""
    node: Any = JOB_DEFAULTS
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    shown = default if node is None else node
    return typer.Option(
        help=f"{help} Sets {key}. (default: {shown})", rich_help_panel="Train job shortcuts"
    )


@app.command()
def train(
    name: Annotated[str, typer.Argument(help="Card id of a full LLM card.")],
    tiny: Annotated[bool, typer.Option(help=_TRAIN_FIELDS["tiny"].description)] = False,
    path: Annotated[Path | None, typer.Option(help=_TRAIN_FIELDS["path"].description)] = None,
    full_size: Annotated[bool, typer.Option(help=_TRAIN_FIELDS["full_size"].description)] = False,
    layers: Annotated[int | None, typer.Option(help=_TRAIN_FIELDS["layers"].description)] = None,
    nproc: Annotated[
        int | None, _job_option("parallel.nproc", "Local ranks (ignored under torchrun).")
    ] = None,
    mesh: Annotated[
        str | None,
        _job_option(
            "parallel.mesh",
            "Mesh over the ranks: 'fsdp' (all ranks shard), 'RxS' (HSDP: R replicas of S "
            "shards), 'ep=2,dp_shard=1' (expert parallelism, MoE cards) or 'pp=2,ep=2' (pipeline "
            "stages; cards whose family is cut into stages, untied embeddings).",
        ),
    ] = None,
    steps: Annotated[
        int | None, _job_option("steps", "Optimizer steps (a resumed run included).")
    ] = None,
    data: Annotated[
        Path | None,
        _job_option("data.path", "Text or JSONL file, or a folder of text.", "Python's stdlib"),
    ] = None,
    max_bytes: Annotated[
        int | None, _job_option("data.max_bytes", "Bytes of text read from --data.")
    ] = None,
    seq_len: Annotated[int | None, _job_option("data.seq_len", "Tokens per sample.")] = None,
    batch_size: Annotated[
        int | None, _job_option("data.batch_size", "Samples per data-parallel rank per step.")
    ] = None,
    seed: Annotated[
        int | None, _job_option("seed", "Seed of the random weights and of the data order.", 0)
    ] = None,
    out_dir: Annotated[
        Path | None,
        _job_option(
            "out_dir",
            "Run folder: model/config.json (--tiny, --full-size), metrics.json, loss.png, "
            "checkpoints.",
            "runs/train/<card>",
        ),
    ] = None,
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config", help="TOML file whose tables are TrainConfig's sections (data, optim, ...)."
        ),
    ] = None,
    set_items: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Any TrainConfig setting, repeatable, as `hyperparallel train --set` takes it: "
            "--set data.global_batch_size=8, --set optim.muon_lr=0.01.",
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the last complete checkpoint in --out-dir.")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            help="Replace an earlier run in --out-dir (what it recorded writing; nothing else)."
        ),
    ] = False,
    allow_config_change: Annotated[
        bool,
        typer.Option(
            help="With --resume: accept model or data settings that differ from the run's "
            "(refused otherwise, naming the fields)."
        ),
    ] = False,
) -> None:
    """Train a full LLM card with hyperparallel (FSDP2/HSDP, Muon + AdamW) and print a summary.

    e.g. `modelzoo train qwen3-0.6b --tiny --nproc 2 --steps 20` (the card's tiny shape, random
    weights, offline: OUT/model/config.json is written and trained), `modelzoo train qwen3-0.6b
    --full-size` (the published shape, random weights, bytes as tokens: no card ships a
    tokenizer; `--layers 2` keeps the first two layers) or `modelzoo train qwen3-8b --path
    ./Qwen3-8B --data corpus.jsonl` (the folder's weights and tokenizer). Writes metrics.json,
    loss.png and DCP checkpoints into --out-dir (default runs/train/<card>); the summary gives
    the medians after the first step of tokens/s, forward + backward and optimizer ms, and
    each rank's peak memory.

    The run is configured exactly as `hyperparallel train` configures it: --config and --set
    address its TrainConfig sections (data, optim, parallel, activation, ...), e.g. `--set
    data.global_batch_size=8`; `hyperparallel train --help` lists every setting. The shortcut
    options below set one key each. Needs the `train` extra (hyperparallel).

    Every check runs before anything is written; a failed rank ends the run with one line
    naming it, its traceback kept in --out-dir's logs folder.
    """
    from torchmind_modelzoo import training
    from torchmind_modelzoo.build import LibraryMissingError

    card = _card(name)
    shortcuts = {
        "nproc": nproc, "mesh": mesh, "steps": steps, "data": data, "max_bytes": max_bytes,
        "seq_len": seq_len, "batch_size": batch_size, "seed": seed, "out_dir": out_dir,
    }  # fmt: skip
    try:
        job = layer_tree(None, config_file, set_items)
        for option, value in shortcuts.items():
            if value is not None:
                set_dotted(job, JOB_FLAGS[option], str(value) if isinstance(value, Path) else value)
        fields = {"tiny": tiny, "path": path, "full_size": full_size, "layers": layers}
        config = TrainOptions.validate_tree({**fields, "job": job})
    except ConfigError as exc:
        fail(str(exc))
    try:
        prepared = training.prepare(
            card,
            config,
            resume=resume,
            overwrite=overwrite,
            allow_config_change=allow_config_change,
            warn=_warn,
        )
    except (LibraryMissingError, InputError) as exc:
        fail(str(exc), code=_exit_code(exc))
    with rank_failures(prepared.out_dir / "logs"):
        try:
            result = training.start(prepared)
        except InputError as exc:  # a checkpoint that does not fit: the user's files
            fail(str(exc), code=_exit_code(exc))
    print(json.dumps(result, indent=2, default=str))


@app.command()
def plan(
    name: Annotated[
        str, typer.Argument(help="Card id of a full LLM card with a published config.")
    ],
    world: Annotated[int, typer.Option(help="Ranks of the run (2 to 16,384 and beyond).")],
    mesh: Annotated[
        str | None,
        _job_option("parallel.mesh", "Mesh over --world ranks, e.g. 'pp=8,ep=8,dp_shard=16'."),
    ] = None,
    seq_len: Annotated[int | None, _job_option("data.seq_len", "Tokens per sample.")] = None,
    batch_size: Annotated[
        int | None, _job_option("data.batch_size", "Samples per data-parallel rank per step.")
    ] = None,
    layers: Annotated[
        int | None,
        typer.Option(
            help="Keep the first N decoder layers at the published width, as `modelzoo train "
            "--full-size --layers N` trains it (does that run fit?)."
        ),
    ] = None,
    device: Annotated[
        str, typer.Option(help="Device profile: h100, h200, ascend-910b, cpu or a .toml file.")
    ] = "h100",
    search: Annotated[
        bool, typer.Option(help="List the meshes of --world that fit, fastest first.")
    ] = False,
    device_memory: Annotated[
        str | None, typer.Option(help="Memory per rank for --search, e.g. 80GiB.")
    ] = None,
    efficiency: Annotated[
        float | None, typer.Option(help="Fraction of peak FLOP/s reached (default 0.5).")
    ] = None,
    config_file: Annotated[
        Path | None, typer.Option("--config", help="TOML file of TrainConfig sections.")
    ] = None,
    set_items: Annotated[
        list[str] | None,
        typer.Option("--set", help="Any TrainConfig setting, as `modelzoo train --set` takes it."),
    ] = None,
) -> None:
    """Predict what training a card at its published size needs at --world ranks (hyperparallel's
    planner: per-rank memory, bytes per collective, Newton-Schulz balance, step time), e.g.
    `modelzoo plan deepseek-v3.2 --world 1024 --mesh pp=8,ep=8,dp_shard=16`. The run is
    configured as `modelzoo train` configures it; a mesh the job refuses is refused in one line.
    Needs the `train` extra (hyperparallel)."""
    from torchmind_modelzoo import planning
    from torchmind_modelzoo.build import LibraryMissingError

    card = _card(name)
    try:
        job = layer_tree(None, config_file, set_items)
        for key, value in {"mesh": mesh, "seq_len": seq_len, "batch_size": batch_size}.items():
            if value is not None:
                set_dotted(job, JOB_FLAGS[key], value)
        TrainOptions.validate_tree({"full_size": True, "layers": layers, "job": job})
        planning.plan_card(
            card,
            job,
            world,
            layers=layers,
            device=device,
            search=search,
            device_memory=device_memory,
            efficiency=efficiency,
            console=console,
        )
    except ConfigError as exc:
        fail(str(exc))
    except (LibraryMissingError, InputError) as exc:
        fail(str(exc), code=_exit_code(exc))


def _warn(message: str) -> None:
    typer.echo(f"warning: {message}", err=True)


def main() -> None:
    """Console-script entry point (a command line click refuses: one line, exit 2)."""
    run_app(app)
