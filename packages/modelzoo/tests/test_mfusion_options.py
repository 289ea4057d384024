"""The card's mfusion options reach mfusion (its pass uuid and report) and change no result."""

from __future__ import annotations

import pytest
import torch

from torchmind_modelzoo import registry
from torchmind_modelzoo.checks import InputError
from torchmind_modelzoo.convert import convert
from torchmind_modelzoo.fusion import mfusion_options
from torchmind_modelzoo.runner import run


@pytest.fixture
def fresh_inductor_cache():
    """Graphs served from Inductor's FX graph cache skip the passes and leave no report entry:
    compile without it so that what mfusion did is really recorded. One compile thread: on a
    2-core machine the worker pool costs more than it saves on these small graphs."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False, compile_threads=1):
        yield
    torch._dynamo.reset()


def _with_mfusion(name: str, options: dict):
    card = registry.get(name)
    return card.model_copy(update={"convert": card.convert.model_copy(update={"mfusion": options})})


def test_fused_ops_become_passes_in_mfusion_order():
    """rms_norm / add_rms_norm / rope / swiglu name mfusion's passes, add_rmsnorm first."""
    assert mfusion_options(registry.get("qwen3-0.6b")) == {
        "passes": ["add_rmsnorm", "rmsnorm", "rope", "swiglu"]
    }
    assert mfusion_options(registry.get("bge-m3")) == {"passes": ["layernorm", "gelu"]}


def test_explicit_card_options_win_over_fused_ops():
    """convert.mfusion naming passes (and other settings) is taken as written."""
    card = _with_mfusion("qwen3-0.6b", {"passes": ["gelu"], "auto_fuse": False})
    assert mfusion_options(card) == {"passes": ["gelu"], "auto_fuse": False}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"passes": ["no_such_pass"]}, r"passes=\['no_such_pass'\] are not known"),
        ({"backend": "tpu"}, r"backend='tpu' is not known"),
        ({"fusion_level": 3}, r"fusion_level"),
    ],
)
def test_bad_card_mfusion_options_are_refused_before_work(tmp_path, options, message):
    """A card whose mfusion options mfusion refuses fails before the model is built, naming
    the card and the field; nothing is written."""
    card = _with_mfusion("qwen3-0.6b", options)
    with pytest.raises(InputError, match=rf"qwen3-0.6b: convert.mfusion .*{message}"):
        convert(card, tmp_path / "out", tiny=True, mfusion=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_convert_with_mfusion_reaches_mfusion_and_matches_eager(tmp_path, fresh_inductor_cache):
    """The manifest's uuid is mfusion's own for the card's passes (not its default), the card's
    passes rewrote the graph, and the compiled program matches eager."""
    import mfusion

    card = registry.get("qwen3-0.6b")
    manifest = convert(card, tmp_path, tiny=True, mfusion=True)
    record = manifest["mfusion"]
    config = mfusion.MFusionConfig(passes=("add_rmsnorm", "rmsnorm", "rope", "swiglu"))
    expected_uuid = mfusion.MFusionPassManager(config).uuid()
    assert record["applied"] is True
    assert record["uuid"] == expected_uuid
    assert record["uuid"] != mfusion.MFusionPassManager(mfusion.MFusionConfig()).uuid()
    assert record["graphs"] >= 1
    assert set(record["rewritten"]) <= {"add_rmsnorm", "rmsnorm", "rope", "swiglu"}
    assert record["rewritten"].get("rmsnorm", 0) > 0, record
    assert record["max_abs_diff_vs_eager"] < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_with_mfusion_matches_the_uncompiled_model(fresh_inductor_cache):
    """run --mfusion compiles with the card's options and scores like the eager model."""
    card = registry.get("qwen3-reranker-0.6b")
    eager = run(card, tiny=True)
    fused = run(card, tiny=True, mfusion=True)
    assert eager["mfusion"] == {"applied": False}
    assert fused["mfusion"]["options"] == {"passes": ["add_rmsnorm", "rmsnorm", "rope", "swiglu"]}
    assert fused["mfusion"]["graphs"] >= 1 and sum(fused["mfusion"]["rewritten"].values()) > 0
    assert fused["result"]["scores"] == pytest.approx(eager["result"]["scores"], abs=1e-5)
