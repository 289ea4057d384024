"""The start-up benchmark: real measurements on 2 ranks, and the CLI's argument checks."""

from __future__ import annotations

import json
import os
import sys

import pytest
from typer.testing import CliRunner

from mccl import bench
from mccl.bench import StartupBenchConfig, measure_startup, results_table
from mccl.cli import app, main
from npu_core.dist import launch


@pytest.mark.distributed
def test_startup_bench_measures_both_paths_with_device_init():
    """Both paths include the simulated device init; mccl overlaps it with initialisation."""
    cfg = StartupBenchConfig(ranks=(2,), rounds=3, calibration_rounds=1, device_init_ms=300.0)
    (result,) = measure_startup(cfg)
    assert result.ranks == 2
    assert result.device_s == pytest.approx(0.3)
    # sync rounds sleep device_s and initialise: strictly longer. Not device_s + init_s / 2:
    # init_s is a median over other rounds, and one round's init varied 6-14 ms here under load.
    assert result.sync_s > result.device_s
    assert result.device_s <= result.mccl_s
    # Not mccl_s < sync_s: at 2 ranks initialisation takes 3-7 ms, the size of mccl's fixed cost
    # and of scheduling noise on a shared 2-core machine (see the README); overlap is what counts.
    assert result.overlap_ratio < 1.5


def _bench_rank_with_async_init_off(cfg: StartupBenchConfig) -> dict:
    # in the rank: ranks come from the launcher's forkserver, not with this process's environ
    os.environ["MCCL_ASYNC_INIT"] = "0"
    return bench._rank_main(cfg)


@pytest.mark.distributed
def test_startup_bench_with_async_init_turned_off_measures_the_blocking_path():
    """MCCL_ASYNC_INIT=0 makes mccl's rounds take the blocking path (no background time to
    report): their init time is then the call's, as for sync (it was None, and the run died
    converting it to a float)."""
    cfg = StartupBenchConfig(ranks=(2,), rounds=1, calibration_rounds=1, device_init_ms=50.0)
    values = launch(_bench_rank_with_async_init_off, 2, cfg, backend=None, timeout=300)[0]
    (init,), (total,) = values["mccl_init"], values["mccl"]
    # the blocking path ran init, then the device init: on every rank total >= init + device,
    # so also for the slowest rank's values (an overlapping, asynchronous init would not be)
    assert init > 0 and init + values["device_s"] <= total, values
    assert values["device_s"] == pytest.approx(0.05)


@pytest.mark.distributed
def test_results_table_writes_json_and_markdown(tmp_path):
    """The table carries the settings and one row per world size."""
    cfg = StartupBenchConfig(ranks=(2,), rounds=1, calibration_rounds=1, device_init_ms=10.0)
    table = results_table(cfg, measure_startup(cfg))
    json_path, md_path = table.write(tmp_path, "startup")
    data = json.loads(json_path.read_text())
    assert data["metadata"]["ranks"] == [2]
    assert [row["ranks"] for row in data["rows"]] == [2]
    assert "| ranks |" in md_path.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ranks", "1"], "ranks: every world size must be >= 2 (got [1])"),
        (["--device-init", "gpu"], "device_init: Input should be 'sleep' or 'compute' (got 'gpu')"),
        (["--rounds", "0"], "rounds: Input should be greater than or equal to 1 (got 0)"),
        (["--set", "rounds=true"], "rounds: a boolean is not a number (got True)"),
        (
            ["--set", "round=3"],
            "round: Extra inputs are not permitted (got 3), choose one of ranks, rounds, "
            "calibration_rounds, device_init, device_init_ms, backend",
        ),
    ],
)
def test_cli_rejects_bad_options_naming_them(args, message):
    """Bad options fail before any rank starts: one stderr line naming the value, exit 2."""
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: invalid configuration: {message}"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "x"], "Invalid value for '--rounds': 'x': Input should be a valid integer"),
        (["--ranks", "2.5"], "Invalid value for '--ranks' / '-n': '2.5': Input should be a valid"),
        (["--round", "3"], "No such option: --round"),
    ],
)
def test_console_script_refuses_unparsable_options_in_one_line(monkeypatch, capsys, args, message):
    """`mccl` itself (main), where click, not the config, refuses: one line too, exit 2."""
    monkeypatch.setattr(sys, "argv", ["mccl", "bench", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
