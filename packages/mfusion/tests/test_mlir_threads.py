"""Row blocks on threads for MLIR regions: which regions split, and that the blocked run equals
eager (threads pinned by the machine profile, never by the machine running the tests)."""

from __future__ import annotations

import pytest
import torch

from mfusion import MFusionConfig
from mfusion.autofuse.fuse import auto_fuse
from mfusion.mlir.importer import import_region
from mfusion.mlir.runtime import compiled_region, run_blocks
from mfusion.mlir.threads import block_module, row_split, split_inputs
from mfusion.report import GraphReport


def rms(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def softmax_mask(s, mask):
    s = s + mask
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def column_sum(x):
    return torch.exp(x).sum(0)


def row_mixing_view(x):
    return torch.exp(x).view(8, 64) * 2.0


@pytest.mark.parametrize(
    ("fn", "args", "rows", "split"),
    [
        (rms, (torch.randn(12, 32), torch.randn(32)), 12, [True, False]),
        # the mask has a leading 1 in the same rank: broadcast along rows, passed whole
        (softmax_mask, (torch.randn(4, 3, 16), torch.randn(1, 3, 16)), 4, [True, False]),
        (column_sum, (torch.randn(12, 32),), None, None),  # reduces over the rows
        (row_mixing_view, (torch.randn(16, 32),), None, None),  # leading size changes
        (rms, (torch.randn(32), torch.randn(32)), None, None),  # rank 1: no rows
    ],
)
def test_row_split(harness, fn, args, rows, split):
    gm = harness.trace(fn, *args)
    assert row_split(gm) == rows
    if rows is not None:
        assert split_inputs(gm, rows) == split


@pytest.mark.parametrize("blocks", [2, 3])
def test_blocked_run_matches_eager(harness, blocks):
    x, mask = torch.randn(6, 4, 32), torch.randn(1, 4, 32)
    gm = harness.trace(softmax_mask, x, mask)
    rows = row_split(gm)
    assert rows == 6
    kernel = compiled_region(import_region(block_module(gm, rows, rows // blocks)))
    out = torch.full_like(x, float("nan"))
    run_blocks(kernel, [x, mask], [out], split_inputs(gm, rows), blocks)
    torch.testing.assert_close(out, softmax_mask(x, mask), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"blocks=4 must divide the 6 rows"):
        run_blocks(kernel, [x, mask], [out], split_inputs(gm, rows), 4)


def test_backend_uses_profile_threads_and_matches_eager(harness, monkeypatch):
    """A two-thread machine profile outlines the region as two row blocks; one thread as one."""
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")
    x, w = torch.randn(8, 64), torch.randn(64)
    for threads, expect in ((2, "2 row blocks on threads"), (1, None)):
        gm = harness.trace(rms, x, w)
        record = GraphReport(0, "mlir-cpu")
        machine = harness.machine("AVX2", {"threads": threads})
        config = MFusionConfig(backend="mlir-cpu", machine=machine)
        assert auto_fuse(gm.graph, config, record) == 1
        gm.recompile()
        reason = record.regions[0].reason
        assert (expect in reason) if expect else ("row blocks" not in reason)
        torch.testing.assert_close(gm(x, w), rms(x, w), atol=1e-5, rtol=1e-5)
