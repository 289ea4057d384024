"""``mccl`` command line: measure what asynchronous initialisation saves at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown

from mccl.bench import StartupBenchConfig, measure_startup, results_table

app = typer.Typer(
    help="Asynchronous initialisation of torch.distributed process groups.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


@app.callback()
def _root() -> None:
    """mccl: start collective initialisation in the background, wait for it at first use."""


@app.command()
def bench(
    ranks: Annotated[
        list[int], typer.Option("--ranks", "-n", help="World size to measure; repeat for several.")
    ] = [2, 8, 32],  # noqa: B006 - typer reads the default, never mutates it
    rounds: Annotated[int, typer.Option(help="Measured rounds per mode (sync, mccl).")] = 5,
    device_init: Annotated[
        str, typer.Option(help="Simulated device init: 'sleep' (idle) or 'compute' (busy CPU).")
    ] = "sleep",
    device_init_ms: Annotated[
        float | None,
        typer.Option(help="Device init duration in ms; default: the measured sync init time."),
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
    try:
        cfg = StartupBenchConfig(
            ranks=tuple(ranks),
            rounds=rounds,
            device_init=device_init,
            device_init_ms=device_init_ms,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    with console.status("starting ranks") as status:
        results = measure_startup(
            cfg, progress=lambda n: status.update(f"measuring {n} ranks on loopback")
        )
    table = results_table(cfg, results)
    json_path, md_path = table.write(out, "startup")
    console.print(Markdown(table.to_markdown()))
    console.print(f"wrote {json_path} and {md_path}")


def main() -> None:
    """Console-script entry point."""
    app()
