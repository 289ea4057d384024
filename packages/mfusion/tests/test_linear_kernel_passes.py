"""The ``linear_kernel`` pass: frozen fp32 linears move from MKL's packed GEMM to oneDNN's where
oneDNN is measured faster on this machine (cached per shape and machine profile), and the
result equals eager. Timers are injected: no outcome depends on the speed of the machine running
the tests (the injected timer still runs both GEMMs once and checks they agree)."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch import nn

import mfusion
from mfusion.passes import linear_kernel

pytestmark = pytest.mark.skipif(
    not (torch._C.has_mkl and torch.backends.mkldnn.is_available()),
    reason="Inductor packs fp32 linears for MKL only in x86 builds with MKL and oneDNN",
)


class FixedTimer:
    """Runs both GEMMs once (they must agree) and reports fixed per-call times."""

    def __init__(self, onednn_s: float, mkl_s: float) -> None:
        self.times = (onednn_s, mkl_s)
        self.calls = 0

    def __call__(self, onednn_call, mkl_call):
        self.calls += 1
        torch.testing.assert_close(onednn_call(), mkl_call(), rtol=1e-4, atol=1e-4)
        return self.times


def _fail_timer(onednn_call, mkl_call):
    raise AssertionError("the cached decision should have been used")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))
    return tmp_path / "linear-kernel"


def test_measured_choice_takes_onednn_only_when_clearly_faster_and_caches_it(harness, cache):
    machine = harness.machine("AVX2")
    with linear_kernel.use_timer(FixedTimer(0.90e-3, 1.00e-3)):
        faster = linear_kernel.choose(32, 48, 64, True, "measure", machine)
    assert faster.onednn and faster.source == "measured"
    with linear_kernel.use_timer(FixedTimer(0.99e-3, 1.00e-3)):  # within MIN_GAIN: a tie
        tie = linear_kernel.choose(32, 48, 64, False, "measure", machine)
    assert not tie.onednn and "ratio 0.99" in tie.describe()
    files = sorted(cache.glob("*.json"))
    assert len(files) == 2
    assert {tuple(json.loads(f.read_text())["mkn"]) for f in files} == {(32, 48, 64)}

    with linear_kernel.use_timer(_fail_timer):
        again = linear_kernel.choose(32, 48, 64, True, "measure", machine)
    assert again.onednn and again.source == "cache"
    other_machine = harness.machine("AVX2", {"threads": 2})  # another profile measures again
    timer = FixedTimer(1.2e-3, 1.0e-3)
    with linear_kernel.use_timer(timer):
        assert not linear_kernel.choose(32, 48, 64, True, "measure", other_machine).onednn
    assert timer.calls == 1


def test_policies_other_than_measure_do_not_time(harness, cache):
    machine = harness.machine("AVX2")
    with linear_kernel.use_timer(_fail_timer):
        assert linear_kernel.choose(8, 8, 8, True, "onednn", machine).onednn
        assert not linear_kernel.choose(8, 8, 8, True, "inductor", machine).onednn
    assert not cache.exists()


def test_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"linear_kernel='blas'.*measure, onednn, inductor"):
        mfusion.MFusionConfig(linear_kernel="blas")


MLP = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 40, bias=False)).eval()
X = torch.randn(24, 48)


def _compile_frozen(**options):
    """The MLP compiled with freezing (weights become constants Inductor packs for MKL)."""
    torch._dynamo.reset()
    mfusion.clear_report()
    compiled = torch.compile(
        MLP,
        options={
            **mfusion.compile_options(passes=("linear_kernel",), auto_fuse=False, **options),
            "fx_graph_cache": False,
        },
    )
    with torch.no_grad(), inductor_config.patch(freezing=True):
        out = compiled(X)
    return out, mfusion.report()


def _decisions(report, rewritten):
    return [
        d
        for g in report.graphs
        for d in g.decisions
        if d.pass_name == "linear_kernel" and d.rewritten is rewritten
    ]


@pytest.mark.parametrize(
    ("policy", "timer", "onednn"),
    [
        ("onednn", None, True),
        ("inductor", None, False),
        ("measure", FixedTimer(0.5e-3, 1.0e-3), True),
        ("measure", FixedTimer(1.5e-3, 1.0e-3), False),
    ],
    ids=["forced-onednn", "kept", "measured-faster", "measured-slower"],
)
def test_frozen_linears_move_to_onednn_where_chosen_and_equal_eager(policy, timer, onednn, cache):
    with torch.no_grad():
        expected = MLP(X)
    if timer is None:
        out, report = _compile_frozen(linear_kernel=policy)
    else:
        with linear_kernel.use_timer(timer):
            out, report = _compile_frozen(linear_kernel=policy)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    moved, kept = _decisions(report, True), _decisions(report, False)
    if onednn:
        assert len(moved) == 2 and not kept
        assert all("oneDNN packed GEMM 24x" in d.reason for d in moved)
    else:
        assert len(kept) == 2 and not moved
        assert all(d.reason.startswith("MKL kept") for d in kept)


def test_unfrozen_graphs_are_left_alone(cache):
    """Without freezing the weights are graph inputs: no MKL-packed linear, nothing to move."""
    torch._dynamo.reset()
    mfusion.clear_report()
    options = mfusion.compile_options(
        passes=("linear_kernel",), auto_fuse=False, linear_kernel="onednn"
    )
    compiled = torch.compile(MLP, options={**options, "fx_graph_cache": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), MLP(X), rtol=1e-5, atol=1e-5)
    report = mfusion.report()
    assert not _decisions(report, True) and not _decisions(report, False)
