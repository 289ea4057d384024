"""Each step's record holds every rank's peak memory of that step (metrics.json).

The reference is an allocation the test makes itself: rank 1 touches a 256 MiB buffer inside
one step, and that step's peak on rank 1 must rise by about that much over its neighbours,
while rank 0's stays where it was and the next step (peak tracking restarted) comes back down.
On CPU the peak is the rank process's peak resident set, which the buffer raises once touched.
"""

from __future__ import annotations

import json

import pytest

from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from hyperparallel.train.trainer import train_rank
from npu_core.dist import launch

BALLAST_MIB = 256
BALLAST_STEP = 3  # 1-based, as in metrics.json


def _train_with_ballast(cfg):
    """A rank of the job in which rank 1 holds :data:`BALLAST_MIB` while it reads the batch
    of step :data:`BALLAST_STEP`, then frees it."""
    import torch
    import torch.distributed as dist

    from hyperparallel.data.stdlib_bytes import ByteBatches

    original = ByteBatches.train_batch

    def train_batch(self, step, *args, **kwargs):
        if dist.get_rank() == 1 and step + 1 == BALLAST_STEP:
            ballast = torch.ones(BALLAST_MIB * 2**20 // 4)  # written: resident, not just mapped
            del ballast
        return original(self, step, *args, **kwargs)

    ByteBatches.train_batch = train_batch
    return train_rank(cfg, False)


@pytest.mark.distributed
def test_each_step_records_every_ranks_peak_memory_of_that_step(tmp_path):
    """Rank 1's peak at the ballast step is >= 200 MiB above the steps around it; rank 0's
    is not; every record lists both ranks."""
    cfg = load_config(debug(), overrides=[f"out_dir={str(tmp_path)!r}", "steps=5"])
    launch(_train_with_ballast, 2, cfg, backend=None, timeout=300)
    records = json.loads((tmp_path / "metrics.json").read_text())["train"]
    peaks = {r["step"]: r["peak_memory_mb"] for r in records}
    assert all(len(p) == 2 and min(p) > 0 for p in peaks.values()), peaks
    before, at, after = (peaks[BALLAST_STEP + d] for d in (-1, 0, 1))
    assert at[1] - before[1] >= 0.8 * BALLAST_MIB, peaks
    assert at[1] - after[1] >= 0.8 * BALLAST_MIB, peaks  # the next step's peak starts afresh
    assert at[0] - before[0] < 0.3 * BALLAST_MIB, peaks
