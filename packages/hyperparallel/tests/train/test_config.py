"""Training configuration layers (preset, TOML, --set) and checkpoint discovery."""

from __future__ import annotations

import pytest

from hyperparallel.train import checkpoint
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from hyperparallel.train.trainer import lr_factor


def test_toml_then_overrides_apply_in_order(tmp_path):
    """A TOML file overrides the preset; --set overrides the file."""
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\n[model]\ndim = 48\n[parallel]\nmesh = "2x2"\n')
    cfg = load_config(debug(), path, ["model.dim=64"])
    assert (cfg.steps, cfg.model.dim, cfg.parallel.mesh) == (7, 64, "2x2")
    assert cfg.model.n_layers == debug().model.n_layers  # untouched fields keep the preset's


@pytest.mark.parametrize(
    ("text", "message"),
    [("steps = [", "not valid TOML"), ("[model]\nwidth = 3\n", "model.width: Extra inputs")],
)
def test_bad_toml_names_file_or_field(tmp_path, text, message):
    """Syntax errors name the file; unknown keys name the field."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(debug(), path)


def test_missing_config_file_is_named(tmp_path):
    """A --config path that does not exist is reported as such."""
    with pytest.raises(ValueError, match=r"--config .*nope.toml: no such file"):
        load_config(debug(), tmp_path / "nope.toml")


def test_lr_schedule_warms_up_then_decays_to_floor():
    """Linear warm-up to 1, cosine decay to min_lr_ratio at the last step."""
    cfg = load_config(debug(), overrides=["steps=100", "optim.warmup_steps=10"])
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(99, cfg) == pytest.approx(cfg.optim.min_lr_ratio, abs=1e-3)
    factors = [lr_factor(s, cfg) for s in range(10, 100)]
    assert factors == sorted(factors, reverse=True)


def test_latest_ignores_partial_checkpoints(tmp_path):
    """A half-written checkpoint (staging folder, no pointer update) is never picked up."""
    (tmp_path / "step_0000010").mkdir()
    (tmp_path / "step_0000010" / ".metadata").write_bytes(b"index")
    checkpoint._write_manifest(tmp_path / "step_0000010")
    (tmp_path / "latest").write_text("step_0000010")
    (tmp_path / ".tmp-step_0000020").mkdir()  # a crash while saving step 20
    assert checkpoint.latest(tmp_path) == tmp_path / "step_0000010"
    assert checkpoint.latest(tmp_path / "missing") is None


def test_activation_policy_names_are_checked():
    """An unknown block policy is refused with the allowed names; per-block lists validate too."""
    from hyperparallel.train.config import TrainConfig, load_config

    cfg = load_config(
        TrainConfig(),
        overrides=["activation.per_block=['selective', 'swap']", "activation.swap_inputs=true"],
    )
    assert cfg.activation.per_block == ["selective", "swap"] and cfg.activation.swap_inputs
    with pytest.raises(ValueError, match=r"activation.policy: .*'sometimes': choose none"):
        load_config(TrainConfig(), overrides=["activation.policy=sometimes"])
    with pytest.raises(ValueError, match=r"activation\.per_block"):
        load_config(TrainConfig(), overrides=["activation.per_block=['bogus']"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["steps=4", "profile_steps=2-5"], "names step 5 but the run has steps=4"),
        (["profile_steps=0"], "'0' is not a step or range"),
        (["profile_steps=3,x"], "'x' is not a step or range"),
    ],
)
def test_profile_steps_must_name_steps_of_the_run(overrides, message):
    """A traced step the run never reaches, or a malformed item, fails before any rank starts."""
    with pytest.raises(ValueError, match=message):
        load_config(debug(), None, overrides)


def test_profile_steps_accept_steps_and_ranges():
    cfg = load_config(debug(), None, ["steps=6", "profile_steps=2,4-6"])
    assert cfg.profile_steps == "2,4-6"
    assert load_config(debug(), None, ["profile_steps=3"]).profile_steps == "3"
