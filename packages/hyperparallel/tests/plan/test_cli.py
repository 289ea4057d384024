"""``hyperparallel plan``: the tables for a layout, mesh search, and refusals in the train job's
own words, one line, before anything is planned."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hyperparallel.cli import app
from hyperparallel.plan import command
from hyperparallel.plan.search import parse_bytes


def _invoke(*args: str):
    return CliRunner().invoke(app, ["plan", "--preset", "debug", *args])


def _lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


# (case id, arguments, the job's one-line message)
REFUSED = [
    ("product not the world", ["--world", "8", "--mesh", "ep=2,dp_shard=2"],
     "4 ranks != world size 8"),
    ("ep not dividing experts", ["--world", "8", "--mesh", "ep=8"],
     "model.n_experts=4 must be divisible by ep x dp_shard = 8 x 1"),
    ("pp above layers", ["--world", "4", "--mesh", "pp=4"],
     "model.n_layers=1 is fewer than the 4 pipeline stages"),
    ("batch not split", ["--world", "8", "--set", "data.global_batch_size=12"],
     "global_batch_size=12 is not divisible by the 8"),
    ("unknown device", ["--world", "2", "--device", "tpu9"],
     "--device tpu9: unknown; choose one of"),
    ("bad memory size", ["--world", "2", "--search", "--device-memory", "lots"],
     "--device-memory 'lots'"),
    ("bad efficiency", ["--world", "2", "--efficiency", "2"], "--efficiency 2.0"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_input_is_refused_before_planning(monkeypatch, args, message):
    """Exit 2, one ``error:`` line with the train job's message; nothing was planned."""

    def never(*_, **__):
        raise AssertionError("planned a refused layout")

    monkeypatch.setattr(command, "make_plan", never)
    monkeypatch.setattr(command, "search_meshes", never)
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    lines = _lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0]


@pytest.mark.parametrize(
    ("mesh", "collective"), [("pp=2,dp_shard=2", "pp"), ("ep=2,dp_shard=2", "expert_fsdp")]
)
def test_a_plan_prints_every_table(mesh, collective):
    """Memory per rank, collectives, Newton-Schulz balance and the step estimate, for a pipeline
    and for experts sharded inside FSDP groups (their own gathers over ``dp_shard`` listed)."""
    result = _invoke("--world", "4", "--mesh", mesh, "--set", "model.n_layers=4")
    assert result.exit_code == 0, result.output
    for title in (
        "Memory per rank",
        "Collectives per step",
        "Newton-Schulz per rank",
        "Step-time estimate on NVIDIA H100",
    ):
        assert title in result.output
    assert mesh in result.output
    assert f"│ {collective} " in result.output


def test_search_lists_only_meshes_that_fit():
    """With a per-rank limit below the smallest layout's peak nothing fits; with room, the
    fitting meshes are listed."""
    tight = _invoke("--world", "4", "--search", "--device-memory", "1KiB")
    assert tight.exit_code == 0, tight.output
    assert "0 fit" in tight.output
    roomy = _invoke("--world", "4", "--search", "--device-memory", "1GiB")
    assert roomy.exit_code == 0, roomy.output
    assert "dp_shard=4" in roomy.output and " 0 fit" not in roomy.output


@pytest.mark.parametrize(
    ("text", "expected"), [("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9), ("1.5e3", 1500)]
)
def test_sizes_parse_in_binary_and_decimal_units(text: str, expected: int):
    assert parse_bytes(text) == expected
