"""``mccl`` command line: measure what asynchronous initialisation saves at start-up."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown

from mccl.bench import StartupBenchConfig, measure_startup, preflight, results_table
from npu_core.cli import HelpGroup, config_options, fail, rank_failures, run_app
from npu_core.config import ConfigError

app = typer.Typer(
    cls=HelpGroup,
    help="Asynchronous initialisation of torch.distributed process groups.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


@app.callback()
def _root() -> None:
    """mccl: start collective initialisation in the background, wait for it at first use."""


@app.command()
@config_options(StartupBenchConfig, exclude=("ranks",))
def bench(
    config: StartupBenchConfig,
    ranks: Annotated[
        list[int] | None,
        typer.Option("--ranks", "-n", help="World size to measure; repeat for several (2, 8, 32)."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory for startup.json and startup.md.")] = Path(
        "bench-results/mccl"
    ),
) -> None:
    """Time barrier -> first all_reduce on N loopback ranks, blocking init versus mccl.

    Each rank simulates a device initialisation (model build, weight load) after starting the
    process group. The blocking path pays init + device; mccl should pay about max(init, device).
    Reported times are medians over rounds of the slowest rank.
    """
    if ranks is not None:  # the option wins over --config / --set, like every other option
        try:
            config = StartupBenchConfig.validate_tree(config.model_dump() | {"ranks": ranks})
        except ConfigError as exc:
            fail(str(exc))
    try:
        preflight(config, out)
    except ValueError as exc:
        fail(str(exc))
    with rank_failures(out / "logs"), console.status("starting ranks") as status:
        results = measure_startup(
            config, progress=lambda n: status.update(f"measuring {n} ranks on loopback")
        )
    table = results_table(config, results)
    json_path, md_path = table.write(out, "startup")
    console.print(Markdown(table.to_markdown()))
    console.print(f"wrote {json_path} and {md_path}")


def main() -> None:
    """Console-script entry point (a command line click refuses: one line, exit 2)."""
    run_app(app)
