"""Distributed checkpoints (torch.distributed.checkpoint) that are complete or absent, never half.

Each checkpoint is written into a temporary folder and renamed into place by rank 0 once every
rank has finished writing; the ``latest`` pointer file is then replaced atomically. A crash while
saving leaves only a ``.tmp-*`` folder, which loading ignores. DCP stores sharded tensors by
fully-qualified name, so a run can resume on a different number of ranks.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

LATEST = "latest"


def _name(step: int) -> str:
    return f"step_{step:07d}"


def save(root: Path, step: int, model: nn.Module, optimizers: tuple[Optimizer, ...]) -> Path:
    """Write model and optimizer state for ``step`` under ``root``; collective over all ranks."""
    final = root / _name(step)
    staging = root / f".tmp-{_name(step)}"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizers),
        "step": step,
    }
    dcp.save(state, checkpoint_id=staging)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
    dist.barrier()
    return final


def latest(root: Path) -> Path | None:
    """The last complete checkpoint under ``root``, or None."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if path.is_dir() else None


def load(path: Path, model: nn.Module, optimizers: tuple[Optimizer, ...]) -> int:
    """Restore model and optimizer state in place (resharding as needed); return the step."""
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizers),
        "step": 0,
    }
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizers, state["optim"])
    return int(state["step"])
