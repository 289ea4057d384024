"""Muon's Newton-Schulz over every mesh layout (FSDP, HSDP, EP x FSDP): each matrix, dense or
expert, orthogonalised exactly once in the job, results equal to torch's NS on whole matrices."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.optim._muon import _zeropower_via_newtonschulz

from hyperparallel.optim import Muon
from hyperparallel.optim.distributed import ShardedNewtonSchulz
from npu_core.dist import launch

KELLER = (3.4445, -4.775, 2.0315)
# Dense: repeated shapes, uneven rows (5 and 3 rows over 2 shards), a conv weight.
DENSE = [(16, 8), (5, 12), (3, 7), (16, 8), (8, 16), (6, 2, 3, 3)]
# Experts [E, M, N]: 8 splits evenly over 4 ranks, 6 does not (3 + 3 over ep, then 2 + 1).
EXPERTS = [(8, 6, 5), (6, 4, 4)]
MATRICES_PER_STEP = len(DENSE) + sum(e for e, _, _ in EXPERTS)

# layout -> (mesh shape, mesh dim names, dense placements, expert placements)
LAYOUTS = {
    "fsdp": ((4,), ("dp_shard",), [Shard(0)], [Shard(0)]),
    "hsdp": (
        (2, 2),
        ("dp_replicate", "dp_shard"),
        [Replicate(), Shard(0)],
        [Replicate(), Shard(0)],
    ),
    "ep": ((2, 2), ("ep", "dp_shard"), [Replicate(), Shard(0)], [Shard(0), Shard(0)]),
    "ep_replicated": ((2, 2), ("ep", "dp_shard"), [Replicate(), Shard(0)], [Shard(0), Replicate()]),
    # The train job's dp_replicate=2,ep=2: experts sharded over ep, replicated over dp_replicate.
    "hsdp_ep": (
        (2, 2),
        ("dp_replicate", "ep"),
        [Replicate(), Shard(0)],
        [Replicate(), Shard(0)],
    ),
}


def _reference_ns(matrix: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's own Newton-Schulz on the whole (gathered) matrix, per expert."""
    if matrix.ndim == 3:
        return torch.stack([_reference_ns(m) for m in matrix])
    flat = matrix.reshape(matrix.shape[0], -1)
    return _zeropower_via_newtonschulz(flat, KELLER, 5, 1e-7).float().reshape(matrix.shape)


def _updates() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in (*DENSE, *EXPERTS)]


def _distribute(layout: str, tensors: list[torch.Tensor]) -> list:
    shape, names, dense, experts = LAYOUTS[layout]
    # A bare mesh, not hyperparallel.parallel.mesh's: the 6 experts here split unevenly over
    # ep x dp_shard (a layout the job refuses), and with torch 2.14 full_tensor() of such a
    # (Shard(0), Shard(0)) DTensor on a sub-mesh whose root also has the flattened dp_shard_ep
    # dimension returns the rows in the wrong order (the local shards are right).
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return [distribute_tensor(t, mesh, experts if t.ndim == 3 else dense) for t in tensors]


class _CountCollectives:
    """Counts collectives issued through torch.distributed while active."""

    NAMES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "broadcast")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(dist, name, counted)


def _run(layout: str) -> dict:
    shapes: list[tuple[int, ...]] = []

    def local(matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        shapes.extend(tuple(m.shape) for m in matrices)
        return [_reference_ns(m) for m in matrices]

    updates = _distribute(layout, _updates())
    engine = ShardedNewtonSchulz(local, batch_bytes=600)  # several batches: overlap path
    outs = engine(updates, updates)
    first = engine.ns_matrices
    engine(updates, updates)  # cached plan path
    counts = torch.tensor([float(first), float(engine.ns_matrices)])
    dist.all_reduce(counts)
    # Experts sharded over ep (and dp_shard) alone: no collective at all.
    expert_only = [u for u in updates if u.ndim == 3]
    with pytest.MonkeyPatch.context() as patch:
        counter = _CountCollectives(patch)
        ShardedNewtonSchulz(local)(expert_only, expert_only)
    # No train layout replicates a parameter over two mesh dims: refused, naming it.
    refusal = None
    mesh = updates[0].device_mesh
    if mesh.ndim == 2:
        twice = distribute_tensor(torch.randn(4, 6, 5), mesh, [Replicate(), Replicate()])
        with pytest.raises(ValueError, match="not supported") as caught:
            ShardedNewtonSchulz(local)([twice], [twice])
        refusal = str(caught.value)
    return {
        "full": [o.full_tensor().tolist() for o in outs],
        "placements": all(o.placements == u.placements for o, u in zip(outs, updates, strict=True)),
        "job_matrices": [int(c) for c in counts.tolist()],
        "rank_matrices": first,
        "expert_collectives": counter.calls,
        "refusal": refusal,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_matrix_orthogonalised_once_per_job_on_every_layout(layout):
    """FSDP 4, HSDP 2x2, ep=2 x dp_shard=2 (experts sharded or replicated over dp_shard) and
    dp_replicate=2 x ep=2: every dense and expert matrix NS'd once in the job, results equal to
    torch's NS on the whole matrices; EP-sharded experts need no collective. No train layout
    replicates a parameter over two dims, so such a parameter is refused naming its placements
    and what is supported (rather than a guessed replica group)."""
    results = launch(_run, 4, layout, timeout=180)
    expected = [_reference_ns(u) for u in _updates()]
    for result in results:
        assert result["placements"]
        for got, want in zip(result["full"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-6)
        assert result["job_matrices"] == [MATRICES_PER_STEP, 2 * MATRICES_PER_STEP]
    # Work is spread: no rank does everything, and no rank is idle.
    per_rank = [r["rank_matrices"] for r in results]
    assert max(per_rank) < MATRICES_PER_STEP and min(per_rank) > 0
    experts_local = layout in ("fsdp", "ep")
    for result in results:
        assert (result["expert_collectives"] == []) is experts_local, result["expert_collectives"]
    if layout != "fsdp":  # 2-D meshes: a parameter replicated over both dims is refused
        for result in results:
            assert "placements (Replicate(), Replicate())" in result["refusal"]
            assert "replicated over 2 mesh dims" in result["refusal"]
            assert "Replicate() over at most one dim" in result["refusal"]


def _muon_steps(layout: str, steps: int) -> list[list]:
    torch.manual_seed(0)
    full = [torch.nn.Parameter(t) for t in _updates()]
    params = [torch.nn.Parameter(d) for d in _distribute(layout, [p.detach() for p in full])]
    opt = Muon(params, lr=0.05, ns_dtype="bf16", adjust_lr="original")
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    return [p.full_tensor().tolist() for p in params]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["hsdp", "ep", "hsdp_ep"])
def test_muon_steps_on_hsdp_and_ep_equal_torch_muon(layout):
    """Two Muon steps on HSDP 2x2, ep=2 x dp_shard=2 and dp_replicate=2 x ep=2 (experts sharded
    over ep, replicated over dp_replicate; dense weights HSDP) equal torch.optim.Muon run on the
    whole matrices (one torch optimizer per expert matrix and per flattened conv weight)."""
    full = [p.clone() for p in _updates()]
    matrices = []  # torch.optim.Muon takes 2-D parameters: experts one by one, conv flattened
    for t in full:
        if t.ndim == 3:
            matrices.extend(torch.nn.Parameter(m.clone()) for m in t)
        else:
            matrices.append(torch.nn.Parameter(t.reshape(t.shape[0], -1).clone()))
    opt = torch.optim.Muon(matrices, lr=0.05, weight_decay=0.1, adjust_lr_fn="original")
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        grads = [torch.randn(t.shape, generator=generator) for t in full]
        flat = []
        for g in grads:
            flat.extend(g if g.ndim == 3 else [g.reshape(g.shape[0], -1)])
        for p, g in zip(matrices, flat, strict=True):
            p.grad = g.clone()
        opt.step()
    expected, k = [], 0
    for t in full:
        n = t.shape[0] if t.ndim == 3 else 1
        block = torch.stack([m.detach() for m in matrices[k : k + n]])
        expected.append(block.reshape(t.shape))
        k += n
    for result in launch(_muon_steps, 4, layout, 2, timeout=180):
        for got, want in zip(result, expected, strict=True):
            # bf16 NS on a [k, M, N] batch and on one matrix at a time round differently
            # (seen: 5e-5 on one element of 96, against updates of ~1e-2): a bf16 tolerance.
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=2e-4)
