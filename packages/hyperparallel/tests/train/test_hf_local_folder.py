"""A local model folder end to end: transformers weights saved with ``save_pretrained`` and a
trained tokenizer in one folder, ``hyperparallel train --model FOLDER --load-weights``, and the
first-step loss against the library's own loss of the same loaded weights on the same batch,
tokenized by the tokenizers library itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from hyperparallel.cli import app
from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.data.tokens import load_text
from hyperparallel.train.config import TrainConfig
from packages.hyperparallel.tests.tiny_hf import FAMILIES, TINY_HF_SHAPE

CORPUS = (
    "a model folder holds its weights, its configuration and its tokenizer; the job reads "
    "all three from the same place and trains the weights it finds there. "
) * 120
"""The training text: few distinct words, so that a 48-entry BPE vocabulary covers it."""

TOKENIZER_VOCAB = 48
"""Below the tiny models' 64 entries: every id the tokenizer makes is one the model has."""

WEIGHT_SEED = 7
"""Seed of the saved weights, unlike the job's ``seed`` (0): a loss equal to the library's
shows the job trained the folder's weights, not random ones of its own seed."""


def _save_model_folder(folder: Path, family: str) -> Tokenizer:
    """A tiny ``family`` model and a BPE tokenizer trained on :data:`CORPUS`, saved into
    ``folder`` by the libraries' own ``save_pretrained``; the tokenizer, for the reference."""
    cls, extra = FAMILIES[family]
    config = getattr(transformers, cls)(**{**TINY_HF_SHAPE, **extra})
    torch.manual_seed(WEIGHT_SEED)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["[UNK]"])
    tok.train_from_iterator([CORPUS], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(folder)
    return tok


def _library_loss(folder: Path, tok: Tokenizer, cfg: TrainConfig, dp_ranks: int) -> float:
    """The reference: the folder's weights loaded by ``from_pretrained`` in one process, and
    the library's own loss (``labels=``) on every data-parallel rank's first batch. The ids
    come from the tokenizers library on the job's data source; only the windows are drawn as
    the job draws them."""
    text = load_text(cfg.data.path, cfg.data.max_bytes).decode()
    ids = torch.tensor(tok.encode(text).ids)
    data = ByteBatches(ids, cfg.data.seq_len, cfg.data.val_fraction, cfg.seed)
    batches = [data.train_batch(0, rank, cfg.data.batch_size) for rank in range(dp_ranks)]
    inputs, targets = (torch.cat([b[i] for b in batches]) for i in (0, 1))
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    windows = torch.cat([inputs, targets[:, -1:]], dim=1)  # the library shifts labels itself
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        loss: torch.Tensor = model(input_ids=windows, labels=windows).loss
    return loss.item()


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_saved_weights_and_tokenizer_train_from_the_librarys_first_loss(
    family: str, tmp_path: Path
):
    folder, out = tmp_path / "model", tmp_path / "out"
    tok = _save_model_folder(folder, family)
    (tmp_path / "corpus.txt").write_text(CORPUS)
    argv = ["train", "--preset", "debug", "--model", str(folder), "--load-weights", "--nproc", "2"]
    argv += ["--data", str(tmp_path / "corpus.txt"), "--steps", "2", "--out-dir", str(out)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    cfg = TrainConfig.model_validate(metrics["config"])
    assert cfg.hf.load_weights and cfg.hf.tokenizer is None  # the model folder's tokenizer
    losses = [r["loss"] for r in metrics["train"]]
    assert len(losses) == 2
    assert abs(losses[0] - _library_loss(folder, tok, cfg, dp_ranks=2)) < 1e-4
