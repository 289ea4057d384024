"""Fixtures shared by hyperparallel's tests (given as fixtures: no test imports another)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def snapshot() -> Callable[[Path], dict[Path, bytes]]:
    """Every file under a folder with its bytes, to show that a refused run changed nothing."""

    def files(folder: Path) -> dict[Path, bytes]:
        return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    return files


@pytest.fixture
def earlier_run(snapshot) -> Callable[[Path], dict[Path, bytes]]:
    """Make a folder look like a finished ``hyperparallel train`` run plus a user's own file."""

    def make(folder: Path) -> dict[Path, bytes]:
        (folder / "checkpoints" / "step_0000010").mkdir(parents=True)
        (folder / "checkpoints" / "latest").write_text("step_0000010")
        (folder / "metrics.json").write_text('{"train": []}')
        (folder / "notes.txt").write_text("the user's own file")
        return snapshot(folder)

    return make


TINY_HF_SHAPE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}


@pytest.fixture
def tiny_hf_shape() -> dict[str, int]:
    """A transformers config shape small enough for a CPU test step (a fresh copy per test):
    each family test adds its own MoE / MLA fields on top."""
    return dict(TINY_HF_SHAPE)
