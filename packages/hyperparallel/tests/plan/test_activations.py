"""Saved-activation bytes predicted on the meta device equal the activation tracker's count on a
real CPU forward of the same block, for every policy, the built-in MoE and transformers MoEs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from hyperparallel.activation import ActivationTracker, checkpoint_wrapper, resolve
from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.plan.activations import ActivationBytes, block_activations
from hyperparallel.plan.inventory import MetaModel, build_meta_model, make_stage, model_inventory
from hyperparallel.train.config import TrainConfig, load_config
from hyperparallel.train.presets import debug
from packages.hyperparallel.tests.tiny_hf import FAMILIES, TINY_HF_SHAPE

MICRO_BATCH, SEQ = 2, 16
POLICIES = [("none", False), ("recompute", False), ("save", False), ("selective", False)]
POLICIES += [("swap", False), ("selective_swap", True), ("recompute", True)]


def _config(source: Path | None, policy: str, swap_inputs: bool) -> TrainConfig:
    overrides = [
        f"activation.policy={policy!r}",
        f"activation.swap_inputs={str(swap_inputs).lower()}",
        "activation.swap_threshold_bytes=0",  # every saved output a policy keeps goes to host
        f"data.seq_len={SEQ}",
    ]
    if source is not None:
        overrides.append(f"hf.source={str(source)!r}")
    return load_config(debug(), overrides=overrides)


def _measured(meta: MetaModel, cfg: TrainConfig, block_index: int, hidden: int) -> ActivationBytes:
    """The tracker's count on a real CPU forward of the job's stage holding one block, that
    block wrapped as the job wraps it."""
    torch.manual_seed(0)
    real = MetaModel(meta.spec, meta.spec.build_module(torch.device("cpu")), meta.local_batch)
    stage = make_stage(real, range(block_index, block_index + 1), False, False)
    block = stage.layers[str(block_index)]
    act = cfg.activation
    if act.policy != "none":
        policy = resolve(act.policy, act.swap_threshold_bytes)
        checkpoint_wrapper(block, policy, swap_inputs=act.swap_inputs)
    x = torch.randn(MICRO_BATCH, SEQ, hidden, requires_grad=True).clone()
    with ActivationTracker() as tracker:
        stage(x)
    report = tracker.report()
    return ActivationBytes(report.device_bytes, report.host_bytes, report.recomputed_bytes)


@pytest.fixture(params=["built-in", "moe", "mla-moe"])
def model_source(request: pytest.FixtureRequest, tmp_path: Path) -> Path | None:
    if request.param == "built-in":
        return None
    class_name, fields = FAMILIES[request.param]
    getattr(transformers, class_name)(**{**TINY_HF_SHAPE, **fields}).save_pretrained(tmp_path)
    return tmp_path / "config.json"


@pytest.mark.parametrize(("policy", "swap_inputs"), POLICIES)
def test_prediction_equals_the_tracker(model_source: Path | None, policy: str, swap_inputs: bool):
    """Device, host and recomputed bytes of the last block, exactly."""
    cfg = _config(model_source, policy, swap_inputs)
    dims = parse_mesh("fsdp", 1)
    meta = build_meta_model(cfg, dims)
    inv = model_inventory(cfg, dims)
    last = inv.n_layers - 1
    predicted = block_activations(meta, inv, cfg.activation, MICRO_BATCH)[last]
    assert predicted == _measured(meta, cfg, last, inv.hidden)
    assert predicted.total > 0
