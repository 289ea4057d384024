"""Three transformers families on FSDP2 (2 gloo ranks) with hyperparallel's Muon + AdamW,
against the single-process model stepped by torch.optim.Muon and torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

from hyperparallel.models.hf import CausalLM
from hyperparallel.optim.hybrid import get_hyper_optimizer
from hyperparallel.parallel.mesh import ParallelDims
from npu_core.dist import launch
from packages.hyperparallel.tests.tiny_hf import FAMILIES, TINY_HF_SHAPE

FSDP_FAMILIES = ("dense", "moe", "mla-moe")
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
ADAMW = {"lr": 1e-3, "weight_decay": 0.1}
AUX_WEIGHT = 0.01


def _wrapped(shape: dict, family: str) -> CausalLM:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**shape, **extra})
    return CausalLM(transformers.AutoModelForCausalLM.from_config(config), chunk_rows=7)


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(64, (4, 16), generator=gen), torch.randint(64, (4, 16), generator=gen)


def _fsdp_step(
    shape: dict, family: str
) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One FSDP2 step on this rank's half of the global batch: (mean loss, grads, new params)."""
    model = _wrapped(shape, family)
    mesh = ParallelDims(dp_shard=2).build("cpu").dense
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = get_hyper_optimizer(
        model,
        muon={**MUON, "adjust_lr": "original", "ns_dtype": "bf16"},
        adamw=ADAMW,
        classify=model.classify,
    )
    tokens, targets = _global_batch()
    rank = dist.get_rank()
    ce, aux = model(tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
    (ce + AUX_WEIGHT * aux).backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    opt.step()
    loss = ce.detach().clone()
    dist.all_reduce(loss)
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return loss.item() / 2, grads, params


def _single_process(shape: dict, family: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss over the global batch and the data-parallel gradient (mean of the halves' losses)."""
    model = _wrapped(shape, family)
    tokens, targets = _global_batch()
    halves = [model(tokens[i : i + 2], targets[i : i + 2]) for i in (0, 2)]
    (sum(ce + AUX_WEIGHT * aux for ce, aux in halves) / 2).backward()
    full_ce = torch.nn.functional.cross_entropy(
        model.model(input_ids=tokens).logits.flatten(0, 1), targets.flatten()
    )
    return full_ce.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _fsdp_steps(shape: dict, families: tuple[str, ...]) -> dict[str, tuple]:
    """:func:`_fsdp_step` for each family in turn, on the same two ranks."""
    return {family: _fsdp_step(shape, family) for family in families}


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict[str, tuple]]:
    """Every family's FSDP2 step in one launch of 2 ranks (each rank's results)."""
    return launch(_fsdp_steps, 2, dict(TINY_HF_SHAPE), FSDP_FAMILIES, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FSDP_FAMILIES)
def test_fsdp2_step_equals_single_process_and_torch_optimizers(
    family: str, tiny_hf_shape: dict, torch_optimizer_step, fsdp_results
):
    assert tiny_hf_shape == TINY_HF_SHAPE  # the launch's shape
    want_loss, want_grads = _single_process(tiny_hf_shape, family)
    results = [per_rank[family] for per_rank in fsdp_results]
    for loss, grads, params in results:
        # same model, same global batch: the first-step loss and gradients of 2 ranks
        assert abs(loss - want_loss) < 1e-4
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        # the distributed update equals torch's optimizers on the gathered matrices
        want = torch_optimizer_step(_wrapped(tiny_hf_shape, family), grads, MUON, ADAMW)
        for name, value in params.items():
            # bf16 Newton-Schulz in the ranks and in this process (other thread counts, batched
            # or one matrix at a time as measured): a few elements round one bf16 step apart,
            # lr x 2^-7 at most; a wrong update is off by lr x O(0.1)
            torch.testing.assert_close(value, want[name], rtol=0, atol=2e-4, msg=name)
