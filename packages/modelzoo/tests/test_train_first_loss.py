"""``modelzoo train``'s first-step loss is the single-process transformers loss of the same model
on the same global batch: the pipeline layouts of a dense, a MoE and an MLA + MoE card (tiny),
and a ``--path`` folder holding weights saved by ``save_pretrained`` and a trained tokenizer.

Each run is the command end to end for one step; the reference is the library's own loss
(``labels=``) in this process, with no stages, no expert placement and no FSDP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.data.tokens import encode, load_text
from hyperparallel.train.config import TrainConfig
from torchmind_modelzoo import registry
from torchmind_modelzoo.cli import app

SMALL = ["--max-bytes", "200000", "--seq-len", "32", "--steps", "1"]

LAYOUTS: dict[str, tuple[str, str, int]] = {
    "dense-pp": ("qwen3-0.6b", "pp=2", 2),
    "moe-pp-ep": ("qwen3-30b-a3b-instruct-2507", "pp=2,ep=2", 4),
    "mla-moe-pp-ep": ("deepseek-v3.2", "pp=2,ep=2", 4),
}
"""Run name -> (card, mesh, ranks). qwen3-0.6b's tiny shape does not tie its embedding to the
head (a tied model is refused under pp), so the dense card is the zoo's smallest."""


def _train(*args: str) -> tuple[list[float], TrainConfig]:
    """``modelzoo train ARGS``: the per-step losses of the summary, and the run's configuration
    as hyperparallel recorded it in metrics.json."""
    result = CliRunner().invoke(app, ["train", *args, *SMALL])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    metrics = json.loads((Path(summary["out_dir"]) / "metrics.json").read_text())
    assert [r["loss"] for r in metrics["train"]] == summary["losses"]
    return summary["losses"], TrainConfig.model_validate(metrics["config"])


def _library_loss(model: Any, ids: torch.Tensor, cfg: TrainConfig, dp_ranks: int) -> float:
    """The transformers model's own loss on every data-parallel rank's first batch, the windows
    of ``ids`` drawn as the job draws them."""
    data = ByteBatches(ids, cfg.data.seq_len, cfg.data.val_fraction, cfg.seed)
    batches = [data.train_batch(0, rank, cfg.data.batch_size) for rank in range(dp_ranks)]
    inputs, targets = (torch.cat([b[i] for b in batches]) for i in (0, 1))
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    windows = torch.cat([inputs, targets[:, -1:]], dim=1)  # the library shifts labels itself
    with torch.no_grad():
        loss: torch.Tensor = model(input_ids=windows, labels=windows).loss
    return loss.item()


@pytest.mark.distributed
@pytest.mark.slow  # 4 ranks (2 for dense) start and import transformers: 20-60 s per run
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pipeline_layouts_start_from_the_single_process_library_loss(layout: str, tmp_path: Path):
    """``modelzoo train CARD --tiny --mesh pp=2[,ep=2]``: the card's tiny model built with the
    run's seed in one process (as the job builds it, from the config.json the run wrote) gives
    the first-step loss within 1e-4."""
    card, mesh, nproc = LAYOUTS[layout]
    out = tmp_path / "run"
    losses, cfg = _train(
        card, "--tiny", "--mesh", mesh, "--nproc", str(nproc), "--out-dir", str(out)
    )
    assert cfg.parallel.mesh == mesh and cfg.parallel.nproc == nproc
    config = transformers.AutoConfig.from_pretrained(out / "model", local_files_only=True)
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = encode(load_text(cfg.data.path, cfg.data.max_bytes), config.vocab_size)  # bytes
    dp_ranks = nproc // 2  # pp=2 times the data-parallel (expert) ranks
    assert abs(losses[0] - _library_loss(model, ids, cfg, dp_ranks)) < 1e-4


CORPUS = "weights and a tokenizer saved side by side in one folder train as one model. " * 150
"""The ``--path`` run's text: few distinct words, covered by a 64-entry BPE vocabulary."""


@pytest.mark.distributed
def test_a_saved_model_folder_with_its_tokenizer_trains_from_the_library_loss(tmp_path: Path):
    """``modelzoo train qwen3-0.6b --path DIR``, DIR holding the card's tiny model saved by
    ``save_pretrained`` and a BPE tokenizer: the first-step loss is the library's loss of those
    weights on ids the tokenizers library makes from the same text (bytes would differ)."""
    card = registry.get("qwen3-0.6b")
    folder = tmp_path / "model"
    config = getattr(transformers, card.architecture).config_class(**card.tiny)
    torch.manual_seed(11)  # not the run's seed: the loss is that of the saved weights
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=64, special_tokens=["[UNK]"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        folder
    )
    (tmp_path / "corpus.txt").write_text(CORPUS)
    out = tmp_path / "run"
    args = ["--path", str(folder), "--data", str(tmp_path / "corpus.txt"), "--out-dir", str(out)]
    losses, cfg = _train("qwen3-0.6b", *args)
    assert cfg.hf.load_weights and cfg.hf.source == str(folder)
    ids = torch.tensor(tok.encode(load_text(cfg.data.path, cfg.data.max_bytes).decode()).ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert abs(losses[0] - _library_loss(model, ids, cfg, dp_ranks=2)) < 1e-4
