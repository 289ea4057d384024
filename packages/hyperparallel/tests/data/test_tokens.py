"""Token ids for transformers models: byte fallback, JSONL, a local tokenizer, resumable windows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.data.tokens import encode, load_text, read_jsonl_text

TEXT = "the quick brown fox jumps over the lazy dog. " * 200


def test_bytes_fold_into_a_small_vocabulary():
    ids = encode(b"\x00\x7f\x80\xff", vocab_size=128)
    assert ids.tolist() == [0, 127, 0, 127]
    assert encode(b"\x00\xff", vocab_size=300).tolist() == [0, 255]  # room for every byte


def test_jsonl_text_fields(tmp_path: Path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate("abc")) + "\n")
    assert read_jsonl_text(path) == b"a\n\nb\n\nc"
    assert load_text(path, max_bytes=3) == b"a\n\n"
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r'docs\.jsonl:2: no string "text" field'):
        read_jsonl_text(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"docs\.jsonl:1: not a JSON object"):
        read_jsonl_text(path)


@pytest.fixture
def tokenizer_folder(tmp_path: Path) -> Path:
    """A word-level tokenizer trained here on TEXT and saved the way transformers loads it."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_local_tokenizer_round_trips(tokenizer_folder: Path):
    ids = encode(TEXT.encode(), vocab_size=64, tokenizer=tokenizer_folder)
    loaded = PreTrainedTokenizerFast.from_pretrained(tokenizer_folder)
    # word-level decoding puts a space between every token, the full stop included
    assert loaded.decode(ids[:10].tolist()) == "the quick brown fox jumps over the lazy dog ."
    assert int(ids.max()) < 64


def test_tokenizer_larger_than_the_model_is_refused(tokenizer_folder: Path):
    with pytest.raises(ValueError, match="the model's vocabulary has 4 entries"):
        encode(TEXT.encode(), vocab_size=4, tokenizer=tokenizer_folder)
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        encode(b"x", vocab_size=64, tokenizer=tokenizer_folder / "absent")


def test_token_windows_are_deterministic_per_step_and_rank():
    ids = encode(TEXT.encode(), vocab_size=128)
    a, b = ByteBatches(ids, seq_len=16, seed=3), ByteBatches(ids.clone(), seq_len=16, seed=3)
    x, y = a.train_batch(step=5, rank=1, batch=2)
    assert torch.equal(x, b.train_batch(5, 1, 2)[0])  # a resumed run draws the same batch
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert int(x.max()) < 128
