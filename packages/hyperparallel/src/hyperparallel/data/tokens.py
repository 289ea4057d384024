"""Text for a transformers model: the model's tokenizer when one is given, else bytes in its vocab.

``--data`` may be a text file, a JSONL file (one JSON object per line, its ``"text"`` field), or a
folder of either. With a tokenizer folder (local files only; nothing is downloaded) documents are
encoded with it; without one, bytes become token ids
directly, folded into the vocabulary (``byte % vocab_size``) when it has fewer than 256 entries,
as the tiny test shapes do. The ids then feed :class:`~hyperparallel.data.stdlib_bytes.ByteBatches`,
whose windows are drawn per (seed, sample, step), so resuming is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hyperparallel.data.stdlib_bytes import read_corpus


def read_jsonl_text(path: Path) -> bytes:
    """The ``"text"`` fields of a JSONL file, one document per line, joined by blank lines.

    Raises:
        ValueError: a line is not JSON or has no string ``"text"`` field (named by line number).
    """
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--data {path}:{number}: not a JSON object ({exc.msg})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f'--data {path}:{number}: no string "text" field')
        texts.append(text)
    return "\n\n".join(texts).encode()


def load_text(source: str | Path | None, max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of text from a text/JSONL file or folder (None: Python's stdlib)."""
    if source is not None and Path(source).suffix == ".jsonl" and Path(source).is_file():
        return read_jsonl_text(Path(source))[:max_bytes]
    return read_corpus(source, max_bytes)


def encode(text: bytes, vocab_size: int, tokenizer: str | Path | None = None) -> torch.Tensor:
    """Token ids ``[N]`` int64 of ``text`` for a model with ``vocab_size`` entries.

    Raises:
        FileNotFoundError: ``tokenizer`` is not a local folder.
        ValueError: the tokenizer produces ids the model's vocabulary does not have.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if tokenizer is None:
        ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        return ids % vocab_size if vocab_size < 256 else ids
    folder = Path(tokenizer)
    if not folder.is_dir():
        raise FileNotFoundError(f"--tokenizer {folder}: not a folder with tokenizer files")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = torch.tensor(tok(text.decode("utf-8", errors="replace"))["input_ids"], dtype=torch.long)
    if len(ids) and int(ids.max()) >= vocab_size:
        raise ValueError(
            f"--tokenizer {folder}: produces token id {int(ids.max())} but the model's "
            f"vocabulary has {vocab_size} entries; use the model's own tokenizer"
        )
    return ids
