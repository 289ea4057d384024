"""Expert parallelism on gloo ranks against the single-process MoE layer (same seed, same data)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyperparallel.models.moe import MoEConfig, MoEFeedForward
from hyperparallel.parallel.expert import apply_expert_parallel
from hyperparallel.parallel.mesh import parse_mesh
from npu_core.dist import launch

pytestmark = pytest.mark.distributed

CFG = MoEConfig(dim=16, n_layers=1, n_heads=2, n_experts=8, top_k=2, ffn_dim=12, max_seq_len=8)


def _inputs(world: int):
    torch.manual_seed(1)
    # uneven load on purpose: one rank's tokens are skewed so splits differ per pair of ranks
    xs = [torch.randn(5 + 3 * r, CFG.dim) * (1 + r) for r in range(world)]
    gs = [torch.randn_like(x) for x in xs]
    return xs, gs


def _reference(world: int):
    torch.manual_seed(0)
    ffn = MoEFeedForward(CFG)
    xs, gs = _inputs(world)
    xs = [x.requires_grad_() for x in xs]
    outs, total = [], 0.0
    for x, g in zip(xs, gs, strict=True):
        out, balance = ffn(x)
        outs.append(out.detach())
        total = total + (out * g).sum() + balance
    (total / world).backward()
    grads = {n: p.grad for n, p in ffn.named_parameters()}
    return outs, [x.grad for x in xs], grads


def _ep_rank(mesh: str):
    world, rank = dist.get_world_size(), dist.get_rank()
    meshes = parse_mesh(mesh, world).build("cpu")
    torch.manual_seed(0)
    ffn = MoEFeedForward(CFG)
    apply_expert_parallel(ffn, meshes)
    xs, gs = _inputs(world)
    x = xs[meshes.dp_rank].requires_grad_()
    out, balance = ffn(x)
    ((out * gs[meshes.dp_rank]).sum() + balance).backward()
    router = ffn.router.weight.grad.clone()
    dist.all_reduce(router)
    grads = {"router.weight": router / world}
    for name in ("w_gate", "w_up", "w_down"):
        grad = getattr(ffn, name).grad
        assert isinstance(grad, DTensor)
        grads[name] = grad.full_tensor()
    local = ffn.w_gate.to_local().shape[0]
    return rank, meshes.dp_rank, out.detach(), x.grad * 1.0, grads, local


@pytest.mark.parametrize(("mesh", "local"), [("ep=2,dp_shard=2", 2), ("ep=4", 2)])
def test_expert_parallel_forward_backward_equal_single_process(mesh, local):
    """Outputs, input gradients and every weight gradient equal the single-process layer
    within fp32 tolerance; each rank stores E / (ep x dp_shard) experts."""
    world = 4
    outs, x_grads, ref = _reference(world)
    for _, dp_rank, out, x_grad, grads, stored in launch(_ep_rank, world, mesh, timeout=240):
        torch.testing.assert_close(out, outs[dp_rank], rtol=1e-5, atol=1e-5)
        # the reference averages over ranks; each rank's own input gradient is unscaled
        torch.testing.assert_close(x_grad / world, x_grads[dp_rank], rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
        assert stored == local
