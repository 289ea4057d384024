"""Expert parallelism for transformers MoE families on gloo ranks, against single-process
transformers: the first-step loss (the library's logits + F.cross_entropy), every gradient, one
Muon + AdamW step (torch.optim.Muon / torch.optim.AdamW on the gathered tensors), and the experts
module alone with skewed routing and skip sentinels."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import Tensor
from torch.distributed.tensor import DTensor

from hyperparallel.models.families import FamilyPlan
from hyperparallel.models.hf import CausalLM
from hyperparallel.models.parallelize import apply_fsdp
from hyperparallel.optim.hybrid import get_hyper_optimizer
from hyperparallel.parallel.hf_expert import apply_hf_expert_parallel, expert_modules
from hyperparallel.parallel.mesh import parse_mesh
from npu_core.dist import launch
from packages.hyperparallel.tests.tiny_hf import FAMILIES, MORE_MOE_FAMILIES

EP_FAMILIES = ("moe", "mla-moe", "gpt-oss")  # MoE, MLA + MoE, expert biases
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
ADAMW = {"lr": 1e-3, "weight_decay": 0.1}
AUX_WEIGHT = 0.01
ROWS = 4  # global batch: 4 sequences of 16 tokens, split over the data-parallel ranks


def _wrapped(shape: dict, family: str) -> CausalLM:
    config_cls, extra = {**FAMILIES, **MORE_MOE_FAMILIES}[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**shape, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # the library starts biases at 0: make them matter in the forward
        for name, param in model.named_parameters():
            if name.endswith("_bias"):
                param.normal_(0.0, 0.1)
    return CausalLM(model, chunk_rows=7)


def _global_batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(64, (ROWS, 16), generator=gen)
    return tokens, torch.randint(64, (ROWS, 16), generator=gen)


def _full(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _ep_step(shape: dict, mesh: str, families: tuple[str, ...] = EP_FAMILIES) -> dict:
    """Per family: EP on the experts + FSDP2 on the rest, one step on this rank's share of the
    global batch: (mean loss, gathered grads, gathered params after the step, experts stored)."""
    meshes = parse_mesh(mesh, dist.get_world_size()).build("cpu")
    results = {}
    for family in families:
        model = _wrapped(shape, family)
        placed = apply_hf_expert_parallel(model.model, model.plan, meshes)
        apply_fsdp(model, meshes.dense, set(placed))
        opt = get_hyper_optimizer(
            model,
            muon={**MUON, "adjust_lr": "original", "ns_dtype": "bf16"},
            adamw=ADAMW,
            classify=model.classify,
        )
        tokens, targets = _global_batch()
        per = ROWS // meshes.dims.dp_size
        rows = slice(meshes.dp_rank * per, (meshes.dp_rank + 1) * per)
        ce, aux = model(tokens[rows], targets[rows])
        (ce + AUX_WEIGHT * aux).backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        stored = {p.to_local().shape[0] for p in placed}
        opt.step()
        params = {n: _full(p) for n, p in model.named_parameters()}
        loss = ce.detach().clone()
        dist.all_reduce(loss)
        results[family] = (loss.item() / dist.get_world_size(), grads, params, stored)
    return results


def _single_process(shape: dict, family: str, parts: int) -> tuple[float, dict[str, Tensor]]:
    """The library's own loss over the global batch (its logits, F.cross_entropy), and the
    data-parallel gradient: the mean of the ``parts`` shares' losses, differentiated."""
    model = _wrapped(shape, family)
    tokens, targets = _global_batch()
    with torch.no_grad():
        logits = model.model(input_ids=tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    per = ROWS // parts
    shares = [model(tokens[i : i + per], targets[i : i + per]) for i in range(0, ROWS, per)]
    (sum(ce + AUX_WEIGHT * aux for ce, aux in shares) / parts).backward()
    return loss, {n: _full(p.grad) for n, p in model.named_parameters()}


def _both(shape: dict, mesh: str) -> tuple[dict[str, tuple], tuple]:
    """Both checks' rank work in one launch (starting ranks costs more than the work)."""
    return _ep_step(shape, mesh), _experts_ep(shape, mesh)


_LAUNCHED: dict[tuple, list] = {}


def _launched(shape: dict, mesh: str, world: int) -> list:
    """Each rank's :func:`_both`, launched once per (shape, mesh) for the tests below."""
    key = (tuple(sorted(shape.items())), mesh, world)
    if key not in _LAUNCHED:
        _LAUNCHED[key] = launch(_both, world, shape, mesh, timeout=280)
    return _LAUNCHED[key]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mesh", "world", "stored"),
    [
        ("ep=2", 2, 2),
        pytest.param("ep=2,dp_shard=2", 4, 1, marks=pytest.mark.slow),
        pytest.param("dp_replicate=2,ep=2", 4, 2, marks=pytest.mark.slow),
    ],
)
def test_ep_step_equals_single_process_and_torch_optimizers(
    mesh: str, world: int, stored: int, tiny_hf_shape: dict, torch_optimizer_step
):
    """Each family's first-step loss equals the single-process transformers loss within 1e-4,
    every gradient (experts gathered) the single-process one, and the step equals
    torch.optim.Muon (each expert its own matrix) and torch.optim.AdamW on the gathered
    tensors; each rank stores E / (ep x dp_shard) experts."""
    results = [steps for steps, _ in _launched(tiny_hf_shape, mesh, world)]
    for family in EP_FAMILIES:
        want_loss, want_grads = _single_process(tiny_hf_shape, family, world)
        model = _wrapped(tiny_hf_shape, family)
        for rank_results in results:
            loss, grads, params, stored_now = rank_results[family]
            assert abs(loss - want_loss) < 1e-4, family
            assert stored_now == {stored}
            assert grads.keys() == want_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            want = torch_optimizer_step(model, grads, MUON, ADAMW)
            for name, value in params.items():
                # bf16 Newton-Schulz in the ranks and in this process (other thread counts, batched
                # or one matrix at a time as measured): a few elements round one bf16 step apart,
                # lr x 2^-7 at most; a wrong update is off by lr x O(0.1)
                torch.testing.assert_close(value, want[name], rtol=0, atol=2e-4, msg=name)


@pytest.mark.distributed
@pytest.mark.slow
def test_ep_other_moe_families_equal_single_process(tiny_hf_shape: dict):
    """GLM-4.5, MiniMax-M2 and Qwen3-Next (linear attention + MoE) under ep=2: the first-step
    loss within 1e-4 of the single-process library loss and every gradient equal."""
    results = launch(_ep_step, 2, tiny_hf_shape, "ep=2", tuple(MORE_MOE_FAMILIES), timeout=280)
    for family in MORE_MOE_FAMILIES:
        want_loss, want_grads = _single_process(tiny_hf_shape, family, 2)
        for rank_results in results:
            loss, grads, _, stored = rank_results[family]
            assert abs(loss - want_loss) < 1e-4, family
            assert stored == {2}
            for name, grad in grads.items():
                if want_grads[name] is None:  # a parameter this batch does not reach
                    assert grad is None, name
                    continue
                torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _experts_module(shape: dict) -> torch.nn.Module:
    """Qwen3-MoE's experts module alone, random weights (its own init leaves them empty)."""
    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(**{**shape, **FAMILIES["moe"][1]})
    model = transformers.AutoModelForCausalLM.from_config(config)
    (_, module), *_ = expert_modules(model, CausalLM(model).plan)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.2)
    return module


EXPERTS_ONLY = FamilyPlan(
    "experts-only", (), "moe", layers="experts", experts=r"^experts\.(?:gate_up_proj|down_proj)$"
)
"""A plan for an experts module alone (held in a ModuleDict under ``experts``)."""


def _routing(world: int, n_experts: int, hidden: int) -> list[tuple[Tensor, ...]]:
    """Per rank: hidden states, top-2 indices, weights and an output gradient. Every token is
    routed to the upper half of the experts (so the ep rank holding the lower half receives no
    rows at all) or to the skip sentinel ``n_experts``."""
    gen = torch.Generator().manual_seed(5)
    inputs = []
    for rank in range(world):
        tokens = 5 + 3 * rank
        index = torch.randint(n_experts // 2, n_experts + 1, (tokens, 2), generator=gen)
        inputs.append(
            (
                torch.randn(tokens, hidden, generator=gen),
                index,
                torch.rand(tokens, 2, generator=gen),
                torch.randn(tokens, hidden, generator=gen),
            )
        )
    return inputs


def _experts_ep(shape: dict, mesh: str) -> tuple[int, Tensor, Tensor, dict[str, Tensor]]:
    """The experts module under EP on this rank's routed tokens: (data rank, output, input
    gradient, gathered weight gradients)."""
    meshes = parse_mesh(mesh, dist.get_world_size()).build("cpu")
    module = _experts_module(shape)
    wrapper = torch.nn.ModuleDict({"experts": module})
    placed = apply_hf_expert_parallel(wrapper, EXPERTS_ONLY, meshes)
    assert len(placed) == 2
    routed = _routing(dist.get_world_size(), module.num_experts, shape["hidden_size"])
    hidden, index, weights, grad = routed[meshes.dp_rank]
    hidden.requires_grad_()
    out = module(hidden, index, weights)
    (out * grad).sum().backward()
    grads = {n: _full(p.grad) for n, p in module.named_parameters()}
    return meshes.dp_rank, out.detach(), hidden.grad.clone(), grads


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mesh", "world"),
    [
        ("ep=2", 2),
        pytest.param("ep=2,dp_shard=2", 4, marks=pytest.mark.slow),
        pytest.param("dp_replicate=2,ep=2", 4, marks=pytest.mark.slow),
    ],
)
def test_experts_with_idle_ranks_and_sentinels_equal_the_library_module(
    mesh: str, world: int, tiny_hf_shape: dict
):
    """The library's eager experts forward (which skips the sentinel index E) on each rank's
    tokens is the reference: outputs, input gradients and the data-parallel mean of the weight
    gradients. One ep rank receives no rows; under dp_shard its slices still take part in the
    gradient reduce-scatter (a missing backward would hang, not differ)."""
    reference = _experts_module(tiny_hf_shape)
    reference.config._experts_implementation = "eager"
    routed = _routing(world, reference.num_experts, tiny_hf_shape["hidden_size"])
    outs, x_grads = [], []
    for hidden, index, weights, grad in routed:
        hidden = hidden.clone().requires_grad_()
        out = reference(hidden, index, weights)
        (out * grad).sum().backward()
        outs.append(out.detach())
        x_grads.append(hidden.grad)
    want = {n: p.grad / world for n, p in reference.named_parameters()}
    for _, (dp_rank, out, x_grad, grads) in _launched(tiny_hf_shape, mesh, world):
        torch.testing.assert_close(out, outs[dp_rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_grad, x_grads[dp_rank], rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)
