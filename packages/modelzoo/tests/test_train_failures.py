"""``modelzoo train`` refusals write nothing, and a failed rank is one line naming it.

The refusals are the issue's command lines, run in a folder where ``tr`` is absent or already
holds a file of the user's; the run folder must be exactly as it was afterwards. The rank
failure goes through the command with hyperparallel's launch replaced by a real two-rank launch
whose rank 1 raises, so the test sees what a user sees without a training run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from npu_core.dist import launch
from torchmind_modelzoo import registry
from torchmind_modelzoo.cli import app

TRAIN = ["train", "qwen3-0.6b", "--tiny", "--out-dir", "tr"]
SMALL = ["--max-bytes", "200000", "--seq-len", "32"]  # a data check of a second, not ten


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` with its file's SHA-256: what "nothing written" compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(root.rglob("*"))
    }


def _refused(args: list[str], folder: Path, expected: str) -> None:
    """``modelzoo train ARGS`` exits 2 with one ``error:`` line holding ``expected``, and leaves
    ``folder`` as it was."""
    before = _tree(folder)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert result.stdout == ""
    assert _tree(folder) == before, "something was written"


@pytest.mark.parametrize("existing", [False, True], ids=["new-out-dir", "out-dir-of-the-user"])
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--mesh", "pp=3"], "--mesh pp=3: pp=3 = 3 ranks != world size 2"),
        (["--mesh", "ep=2,dp_shard=1"], "ep=2 needs a MoE model"),
        (["--resume"], "--resume: tr holds no --tiny run to continue"),
        (["--seq-len", "100000"], "data.seq_len=100000 exceeds max_position_embeddings=128"),
    ],
)
def test_a_refused_tiny_run_writes_nothing(tmp_path, monkeypatch, args, expected, existing):
    """The model's config.json is checked where it is built, outside the out-dir, and written
    into it only after every check has passed: no ``tr``, or the user's ``tr`` untouched."""
    monkeypatch.chdir(tmp_path)
    if existing:
        (tmp_path / "tr").mkdir()
        (tmp_path / "tr" / "notes.txt").write_text("mine\n")
    _refused([*TRAIN, *args], tmp_path, expected)
    assert (tmp_path / "tr").exists() is existing


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_model_folder_of_the_users_is_neither_overwritten_nor_removed(
    tmp_path, monkeypatch, overwrite
):
    """An out-dir whose ``model`` folder the run did not record writing (the user's own) is
    refused, --overwrite or not: writing the tiny config.json there would replace theirs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tr" / "model").mkdir(parents=True)
    (tmp_path / "tr" / "model" / "config.json").write_text('{"mine": true}\n')
    _refused(
        [*TRAIN, *SMALL, *overwrite],
        tmp_path,
        "--out-dir tr holds model, which this run would write into but did not create",
    )


def test_a_path_whose_weights_do_not_fit_its_config_writes_nothing(tmp_path, monkeypatch):
    """``--path`` a folder whose config.json was changed after its weights were saved (two
    layers saved, three configured): refused by hyperparallel's weight check before any rank
    starts, naming the folder and counting the tensors that would start random."""
    monkeypatch.chdir(tmp_path)
    card = registry.get("qwen3-0.6b")
    config = getattr(transformers, card.architecture).config_class(**card.tiny)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "saved")
    settings = json.loads((tmp_path / "saved" / "config.json").read_text())
    settings.update(num_hidden_layers=3, layer_types=["full_attention"] * 3)
    (tmp_path / "saved" / "config.json").write_text(json.dumps(settings))
    # one block: q, k, v, o, q_norm, k_norm, two norms, gate, up, down
    expected = "do not fit its config.json: 11 missing (model.layers.2."
    _refused(
        ["train", "qwen3-0.6b", "--path", "saved", "--out-dir", "tr", *SMALL], tmp_path, expected
    )
    assert not (tmp_path / "tr").exists()


def _fault_in_rank_one() -> str:
    """A rank's work: rank 1 fails, as a rank does when its training raises."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("a fault in rank 1 (raised by the test)")
    return "done"


@pytest.mark.distributed
def test_a_failed_rank_is_one_line_naming_it_with_its_traceback_kept(tmp_path, monkeypatch):
    """Exit 1, one ``error:`` line naming rank 1 and its error, the traceback in
    ``tr/logs/rank1.log`` and none on the terminal."""
    from hyperparallel.train import job

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "start", lambda cfg, **_: launch(_fault_in_rank_one, 2))
    result = CliRunner().invoke(app, [*TRAIN, *SMALL])
    assert result.exit_code == 1, result.output
    log = Path("tr") / "logs" / "rank1.log"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: rank 1: ValueError: a fault in rank 1 (raised by the test) (traceback in {log})"
    ]
    assert "Traceback" not in result.stderr
    kept = (tmp_path / log).read_text()
    assert "Traceback" in kept and "_fault_in_rank_one" in kept
