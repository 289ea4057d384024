"""``--profile-steps``: a Chrome trace per rank for the chosen steps only, holding that step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hyperparallel.train.profiling import StepProfiler, parse_profile_steps


def _train(profiler: StepProfiler, steps: int) -> None:
    """A small training loop; each step's work carries a marker naming its step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        with profiler.step(step), torch.profiler.record_function(f"marker_of_step_{step}"):
            loss = model(torch.randn(8, 16)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()


def _names(path) -> set[str]:
    trace = json.loads(path.read_text())
    return {event.get("name", "") for event in trace["traceEvents"]}


def test_traces_are_written_for_the_chosen_steps_only(tmp_path):
    profiler = StepProfiler("2,4", tmp_path, rank=3)
    _train(profiler, 5)
    folder = tmp_path / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank3_step2.json", "rank3_step4.json"]
    assert profiler.written == [folder / "rank3_step2.json", folder / "rank3_step4.json"]
    for step in (2, 4):
        names = _names(folder / f"rank3_step{step}.json")
        # The chosen step's own work, and nothing of the steps around it.
        assert {f"marker_of_step_{step}", f"train_step_{step}", "aten::addmm"} <= names
        others = {f"marker_of_step_{s}" for s in range(1, 6) if s != step}
        assert not names & others


def test_no_chosen_step_writes_nothing(tmp_path):
    _train(StepProfiler("", tmp_path, rank=0), 3)
    _train(StepProfiler("7", tmp_path, rank=0), 3)  # beyond the run
    assert not (tmp_path / "profile").exists()


def test_a_failing_step_writes_no_trace(tmp_path):
    profiler = StepProfiler([1], tmp_path, rank=0)
    with pytest.raises(RuntimeError, match="boom"), profiler.step(1):
        raise RuntimeError("boom")
    assert not list((tmp_path / "profile").iterdir())


@pytest.mark.parametrize(
    ("spec", "steps"),
    [("3,4", {3, 4}), ("3-6", {3, 4, 5, 6}), (" 2, 5-6 ", {2, 5, 6}), ("", set()), ("1", {1})],
)
def test_step_grammar(spec, steps):
    assert parse_profile_steps(spec) == steps


@pytest.mark.parametrize("spec", ["0", "4-2", "x", "3,", "-1", "2.5"])
def test_bad_steps_are_refused_naming_the_item(spec):
    with pytest.raises(ValueError, match=r"profile_steps=.*is not a step or range"):
        parse_profile_steps(spec)
