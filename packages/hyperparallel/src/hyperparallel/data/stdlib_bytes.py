"""Byte-level text corpora that need no download: Python's own standard library by default.

Tokens are raw bytes (vocabulary 256). The corpus is split by position into training and held-out
validation bytes; each sample is a random window drawn with a generator seeded by (seed, sample,
step), so a resumed run draws exactly the batches the uninterrupted run would have, and layouts
with the same global batch draw the same samples.
"""

from __future__ import annotations

import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".toml", ".json", ".cfg", ".ini", ".html")


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(source: str | Path | None = None, max_bytes: int = 8_000_000) -> bytes:
    """Read up to ``max_bytes`` of text from a file, a folder (its text files, sorted), or the
    standard library (``source=None``).

    A file that looks binary (a NUL byte in its first 8 KiB, git's test) is refused when named
    directly and skipped with a warning inside a folder: training on bytes of an archive or an
    image runs without error and learns nothing useful, so it must not pass silently.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        ValueError: it is binary, holds no text, or too little to train on.
    """
    suffixes: tuple[str, ...]
    if source is None:
        root, suffixes = stdlib_root(), (".py",)
    else:
        root, suffixes = Path(source), TEXT_SUFFIXES
        if not root.exists():
            raise FileNotFoundError(f"--data {root}: no such file or folder")
    files = [root] if root.is_file() else _text_files(root, suffixes)
    chunks, size, binary = [], 0, []
    for path in files:
        data = path.read_bytes()
        if _looks_binary(data):
            if path == root:
                raise ValueError(
                    f"--data {root}: a binary file (NUL byte at offset {data.index(0)}); "
                    "pass a text file or a folder of text files"
                )
            binary.append(path)
            continue
        chunks.append(data[: max_bytes - size])
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    if binary:
        warnings.warn(
            f"--data {root}: skipped {len(binary)} binary file(s): {binary[0]}"
            + (f" and {len(binary) - 1} more" if len(binary) > 1 else ""),
            RuntimeWarning,
            stacklevel=2,
        )
    corpus = b"".join(chunks)
    if len(corpus) < 4096:
        raise ValueError(
            f"--data {root}: only {len(corpus)} bytes of text found (need at least 4096; "
            f"folders are searched for {', '.join(suffixes)} files)"
        )
    return corpus


def _text_files(folder: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    """Files with ``suffixes`` under ``folder`` in sorted-path order, walked lazily: reading stops
    at ``max_bytes``, and listing the whole standard library first took seconds."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir():
            yield from _text_files(Path(entry.path), suffixes)
        elif entry.is_file() and Path(entry.name).suffix in suffixes:
            yield Path(entry.path)


def _looks_binary(data: bytes) -> bool:
    return 0 in data[:8192]


class ByteBatches:
    """Random fixed-length windows of a byte corpus, split into train and validation parts.

    Args:
        corpus: the bytes, or a 1-D tensor of token ids (:mod:`hyperparallel.data.tokens`).
        seq_len: tokens per sample (each window holds seq_len + 1 bytes: inputs and targets).
        val_fraction: tail share of the corpus held out for validation.
        seed: base seed; sample ``j`` of ``step`` is reproducible from (seed, j, step).
    """

    def __init__(
        self, corpus: bytes | torch.Tensor, seq_len: int, val_fraction: float = 0.05, seed: int = 0
    ):
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if isinstance(corpus, torch.Tensor):  # token ids already (hyperparallel.data.tokens)
            data = corpus.long().flatten()
        else:
            data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        split = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:split], data[split:]
        if len(self.val) <= seq_len + 1 or len(self.train) <= seq_len + 1:
            raise ValueError(
                f"corpus of {len(data)} bytes is too small for seq_len={seq_len} "
                f"with val_fraction={val_fraction}"
            )
        self.seq_len, self.seed = seq_len, seed

    def _windows(
        self, data: torch.Tensor, samples: range, key: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One generator per (sample, key): sample j of a step is the same window whichever
        # rank draws it, so layouts with the same global batch see the same data.
        starts = [
            int(torch.randint(0, len(data) - self.seq_len - 1, (1,), generator=g))
            for g in (_generator(self.seed, j, key) for j in samples)
        ]
        windows = torch.stack([data[s : s + self.seq_len + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]

    def train_batch(self, step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``[batch, seq_len]`` int64 of data-parallel ``rank`` at ``step``:
        samples ``rank * batch ... rank * batch + batch - 1`` of the step's global batch."""
        return self._windows(self.train, range(rank * batch, (rank + 1) * batch), step)

    def val_batches(
        self, rank: int, batch: int, count: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same ``count`` held-out batches every time it is called (for comparable losses),
        drawn like :meth:`train_batch` so every layout validates on the same samples."""
        samples = range(rank * batch, (rank + 1) * batch)
        return [self._windows(self.val, samples, -1 - i) for i in range(count)]


def _generator(seed: int, sample: int, step: int) -> torch.Generator:
    # Arithmetic, not hash(): str hashes change per process, and every rank and every resumed
    # run must derive the same stream.
    return torch.Generator().manual_seed(((seed * 1_000_003 + sample) * 1_000_003 + step) % 2**63)
