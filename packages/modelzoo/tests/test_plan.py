"""``modelzoo plan``: a card's published model planned at N ranks by hyperparallel's planner, and
every refusal one line before anything is planned (card, mesh product, experts, stages)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from torchmind_modelzoo.cli import app

pytest.importorskip("hyperparallel")


def _refused(args: list[str], expected: str) -> None:
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["qwen3-8b", "--world", "8"],
            "qwen3-8b has no published config in its card (config:); modelzoo plan takes "
            "deepseek-v3.2, qwen3-0.6b, qwen3-30b-a3b-instruct-2507",
        ),
        (
            ["deepseek-v3.2", "--world", "1024", "--mesh", "pp=8,ep=8,dp_shard=8"],
            "pp=8 x ep=8 x dp_shard=8 = 512 ranks != world size 1024",
        ),
        (
            ["deepseek-v3.2", "--world", "12", "--mesh", "ep=3,dp_shard=4"],
            "n_routed_experts=256 must be divisible by ep x dp_shard = 3 x 4",
        ),
        (
            ["qwen3-30b-a3b-instruct-2507", "--world", "64", "--mesh", "pp=64"],
            "fewer than the 64 pipeline stages",
        ),
        (
            ["qwen3-0.6b", "--world", "2", "--layers", "29"],
            "--layers 29",
        ),
    ],
)
def test_a_refused_plan_is_one_line(monkeypatch, args, expected):
    """Exit 2 with hyperparallel's one-line message; the planner never ran."""
    from hyperparallel.plan import command

    def never(*_, **__):
        raise AssertionError("planned a refused layout")

    monkeypatch.setattr(command, "make_plan", never)
    _refused(args, expected)


def test_a_card_is_planned_at_its_published_size():
    """qwen3-30b-a3b at 16 ranks: the published 30.5 B parameters, 48 blocks, and the tables."""
    result = CliRunner().invoke(
        app, ["plan", "qwen3-30b-a3b-instruct-2507", "--world", "16", "--mesh", "2x8"]
    )
    assert result.exit_code == 0, result.output
    assert "Qwen3MoeForCausalLM: 30.5 B parameters, 48 blocks; world 16" in result.output
    for title in ("Memory per rank", "Newton-Schulz per rank", "Step-time estimate"):
        assert title in result.output


def test_layers_plans_the_first_layers_at_the_published_width():
    """--layers 1 of qwen3-30b-a3b on 2 ranks, as `modelzoo train --full-size --layers 1` runs it:
    128 experts of 3 x 2048 x 768 (604 M) and the untied embedding and head (2 x 311 M) make
    1.25 B parameters in one block."""
    result = CliRunner().invoke(
        app,
        ["plan", "qwen3-30b-a3b-instruct-2507", "--world", "2", "--mesh", "ep=2", "--layers", "1"],
    )
    assert result.exit_code == 0, result.output
    assert "Qwen3MoeForCausalLM: 1.25 B parameters, 1 blocks; world 2" in result.output
