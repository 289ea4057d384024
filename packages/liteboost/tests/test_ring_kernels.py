"""Ring attention's chunk kernels are plug-ins: chosen per device by the registry, and logged.

The per-device table below is the documented choice (flash on CPU, memory-efficient on CUDA,
fp32 softmax elsewhere; fused sparse on CPU, block gather elsewhere); the multi-rank test
registers a fake kernel and checks that ring attention's output is the fake's, which it can only
be when ring attention asks the registry.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from liteboost.parallel.ring import RingAttention, tiled_chunk
from liteboost.parallel.ring_kernels import (
    RING_DENSE_KERNELS,
    RING_SPARSE_KERNELS,
    ChunkCall,
    select_dense_kernel,
    select_sparse_kernel,
)
from npu_core.dist import launch
from npu_core.plugins import DeviceDtype, Plugin, PluginError

DENSE_CHOICES = [
    (ChunkCall("cpu", torch.float32), "flash_cpu"),
    (ChunkCall("cpu", torch.bfloat16), "flash_cpu"),
    (ChunkCall("cuda", torch.bfloat16), "efficient_cuda"),
    (ChunkCall("cuda", torch.float64), "math"),  # the efficient kernel has no fp64
    (ChunkCall("npu", torch.float16), "math"),
]
SPARSE_CHOICES = [
    (ChunkCall("cpu", torch.float32), "cpu"),
    (ChunkCall("cuda", torch.bfloat16), "gather"),
    (ChunkCall("npu", torch.float16), "gather"),
]


@pytest.mark.parametrize(("call", "expected"), DENSE_CHOICES, ids=str)
def test_registry_picks_the_dense_chunk_kernel_per_device(call, expected):
    assert select_dense_kernel(call).name == expected


@pytest.mark.parametrize(("call", "expected"), SPARSE_CHOICES, ids=str)
def test_registry_picks_the_sparse_chunk_kernel_per_device(call, expected):
    assert select_sparse_kernel(call).name == expected


def test_forced_sparse_kernel_that_cannot_run_is_refused_with_the_reason():
    with pytest.raises(PluginError, match=r"'cpu' cannot run this call: device 'cuda'"):
        select_sparse_kernel(ChunkCall("cuda", torch.float16), "cpu")
    with pytest.raises(PluginError, match=r"unknown ring sparse chunk kernel 'bogus'.*gather"):
        select_sparse_kernel(ChunkCall("cpu", torch.float32), "bogus")


def test_each_chunk_kernel_choice_is_logged_at_info(caplog):
    fake = Plugin("logged", _fake_dense, DeviceDtype(("cpu",)), priority=0)
    with RING_DENSE_KERNELS.registered(fake), caplog.at_level(logging.INFO, "npu_core.plugins"):
        select_dense_kernel(ChunkCall("cpu", torch.float32))
    assert any("ring dense chunk kernel logged" in r.getMessage() for r in caplog.records)


FAKE_VALUE = 7.0


def _fake_dense(q, k, v, scale):
    _fake_dense.calls += 1  # type: ignore[attr-defined]
    return torch.full_like(q, FAKE_VALUE), torch.zeros(q.shape[:-1])


def _fake_sparse(q, k, v, block_index, block_size, scale):
    _fake_sparse.calls += 1  # type: ignore[attr-defined]
    return torch.full_like(q, FAKE_VALUE), torch.zeros(q.shape[:-1])


GRID = (2, 4, 8)  # 64 tokens: two chunks of 32, two 16-token blocks each


@torch.no_grad()
def _ring_with_fakes(q, k, v) -> dict:
    """Dense and sparse ring attention, first with the stock kernels, then with fakes
    registered ahead of them on CPU."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ring = RingAttention(None)
    chunk = q.shape[2] // world
    dense_chunks = [t[:, :, rank * chunk : (rank + 1) * chunk].transpose(1, 2) for t in (q, k, v)]
    sparse_chunks = [tiled_chunk(t, GRID, world, rank, block_size=16) for t in (q, k, v)]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        dense = ring(*dense_chunks, seq_len=q.shape[2])
        sparse = ring.sparse(*sparse_chunks, latent_shape=GRID, sparsity=0.5, block_size=16)
        return dense, sparse

    stock = run()
    _fake_dense.calls = _fake_sparse.calls = 0  # type: ignore[attr-defined]
    dense_fake = Plugin("fake", _fake_dense, DeviceDtype(("cpu",)), priority=0)
    sparse_fake = Plugin("fake", _fake_sparse, DeviceDtype(("cpu",)), priority=0)
    with RING_DENSE_KERNELS.registered(dense_fake), RING_SPARSE_KERNELS.registered(sparse_fake):
        faked = run()
    calls = (_fake_dense.calls, _fake_sparse.calls)  # type: ignore[attr-defined]
    return {"stock": stock, "faked": faked, "calls": calls}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ring_attention_runs_the_kernel_the_registry_chooses(qkv_factory):
    """With a fake kernel registered ahead, both ring paths return the fake's output, and
    call it once per chunk they attend; without it the dense ring equals SDPA."""
    world = 2
    q, k, v = qkv_factory(GRID, heads=2, dim=16, batch=1)
    results = launch(_ring_with_fakes, world, q, k, v, timeout=300)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    dense = torch.cat([r["stock"][0] for r in results], dim=1).transpose(1, 2)
    torch.testing.assert_close(dense, expected, atol=2e-5, rtol=1e-5)
    for rank, result in enumerate(results):
        dense_faked, sparse_faked = result["faked"]
        assert (dense_faked == FAKE_VALUE).all() and (sparse_faked == FAKE_VALUE).all()
        dense_calls, sparse_calls = result["calls"]
        assert dense_calls == world, f"rank {rank}: one dense call per chunk"
        assert 1 <= sparse_calls <= world, f"rank {rank}: at most one sparse call per chunk"
