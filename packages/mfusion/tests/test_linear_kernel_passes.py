"""The ``linear_kernel`` pass: frozen fp32 linears move from MKL's packed GEMM to oneDNN's where
oneDNN is measured faster on this machine (cached per shape and machine profile), and the
result equals eager. Timers are injected: no outcome depends on the speed of the machine running
the tests (the injected timer still runs both GEMMs once and checks they agree)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn

import mfusion
from mfusion.passes import linear_kernel
from npu_core import decisions
from npu_core.timing import use_timer

pytestmark = pytest.mark.skipif(
    not (torch._C.has_mkl and torch.backends.mkldnn.is_available()),
    reason="Inductor packs fp32 linears for MKL only in x86 builds with MKL and oneDNN",
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))
    return tmp_path / "linear-kernel"


def test_measured_choice_takes_onednn_only_when_clearly_faster_and_caches_it(harness, cache):
    machine = harness.machine("AVX2")
    with use_timer(harness.fixed_timer(0.90e-3, 1.00e-3, agree=True)):
        faster = linear_kernel.choose(32, 48, 64, True, "measure", machine)
    assert faster.chosen and faster.source == "measured"
    tie_timer = harness.fixed_timer(0.99e-3, 1.00e-3, agree=True)  # within MIN_GAIN: a tie
    with use_timer(tie_timer):
        tie = linear_kernel.choose(32, 48, 64, False, "measure", machine)
    assert not tie.chosen and "ratio 0.99" in tie.describe()
    files = sorted(cache.glob("*.json"))
    assert len(files) == 2
    assert {tuple(json.loads(f.read_text())["fields"]["mkn"]) for f in files} == {(32, 48, 64)}

    with use_timer(harness.failing_timer):
        again = linear_kernel.choose(32, 48, 64, True, "measure", machine)
    assert again.chosen and again.source == "cache"
    other_machine = harness.machine("AVX2", {"threads": 2})  # another profile measures again
    timer = harness.fixed_timer(1.2e-3, 1.0e-3, agree=True)
    with use_timer(timer):
        assert not linear_kernel.choose(32, 48, 64, True, "measure", other_machine).chosen
    assert timer.calls == 1


def test_policies_other_than_measure_do_not_time(harness, cache):
    machine = harness.machine("AVX2")
    with use_timer(harness.failing_timer):
        assert linear_kernel.choose(8, 8, 8, True, "onednn", machine).chosen
        assert not linear_kernel.choose(8, 8, 8, True, "inductor", machine).chosen
    assert not cache.exists()


def test_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"linear_kernel='blas'.*measure, onednn, inductor"):
        mfusion.MFusionConfig(linear_kernel="blas")


MLP = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 40, bias=False)).eval()
X = torch.randn(24, 48)


def _compile_frozen(module, x, **options):
    """``module(x)`` compiled with freezing (weights become constants Inductor packs for MKL)."""
    torch._dynamo.reset()
    mfusion.clear_report()
    compiled = torch.compile(
        module,
        options={
            **mfusion.compile_options(auto_fuse=False, **options),
            "fx_graph_cache": False,
        },
    )
    with torch.no_grad(), inductor_config.patch(freezing=True):
        out = compiled(x)
    return out, mfusion.report()


def _decisions(report, rewritten):
    return [
        d
        for g in report.graphs
        for d in g.decisions
        if d.pass_name == "linear_kernel" and d.rewritten is rewritten
    ]


@pytest.mark.parametrize(
    ("policy", "times", "onednn"),
    [
        ("onednn", None, True),
        ("inductor", None, False),
        ("measure", (0.5e-3, 1.0e-3), True),
        ("measure", (1.5e-3, 1.0e-3), False),
    ],
    ids=["forced-onednn", "kept", "measured-faster", "measured-slower"],
)
def test_frozen_linears_move_to_onednn_where_chosen_and_equal_eager(
    policy, times, onednn, harness, cache
):
    with torch.no_grad():
        expected = MLP(X)
    if times is None:
        out, report = _compile_frozen(MLP, X, passes=("linear_kernel",), linear_kernel=policy)
    else:
        with use_timer(harness.fixed_timer(*times, agree=True)):
            out, report = _compile_frozen(MLP, X, passes=("linear_kernel",), linear_kernel=policy)
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


class _Head(nn.Module):
    """A frozen linear, then ``activation`` of its (3-D) output, as library models write it."""

    def __init__(self, activation) -> None:
        super().__init__()
        self.proj, self.gate, self.activation = nn.Linear(48, 64), nn.Linear(48, 64), activation

    def forward(self, x):
        return self.activation(self, x)


def _erf_gelu_by_hand(m, x):
    h = m.proj(x)
    return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))


def _tanh_gelu_by_hand(m, x):
    h = m.proj(x)
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * torch.pow(h, 3))))


ACTIVATION_FORMS = {
    "nn.GELU": ("gelu", lambda m, x: F.gelu(m.proj(x))),
    "erf GELU by hand": ("gelu", _erf_gelu_by_hand),
    "nn.GELU(tanh)": ("gelu-tanh", lambda m, x: F.gelu(m.proj(x), approximate="tanh")),
    "tanh GELU by hand": ("gelu-tanh", _tanh_gelu_by_hand),
    "F.silu": ("silu", lambda m, x: F.silu(m.proj(x))),
    "relu": ("relu", lambda m, x: torch.relu(m.proj(x))),
}


def _compile_head(activation, **options):
    """A linear + ``activation`` head compiled frozen with every pass (the activation reaches
    ``linear_kernel`` in the form the earlier passes leave), its eager output, and the rewrites."""
    module, x = _Head(activation).eval(), torch.randn(2, 12, 48)
    out, report = _compile_frozen(module, x, **options)
    with torch.no_grad():
        expected = module(x)
    return out, expected, _decisions(report, True)


@pytest.mark.parametrize("form", list(ACTIVATION_FORMS))
def test_activation_behind_a_linear_runs_in_onednn_epilogue_and_equals_eager(form, cache):
    """Every spelling Inductor's decompositions leave of each activation is recognised by what it
    computes, fused as oneDNN's post-op, and the result equals eager."""
    name, activation = ACTIVATION_FORMS[form]
    out, expected, moved = _compile_head(activation, linear_kernel="onednn")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    fused = [d for d in moved if d.reason.split(":")[0].endswith(f"+ {name}")]
    assert len(fused) == 1, [d.reason for d in moved]


@pytest.mark.parametrize(
    "form",
    [
        "pre-activation also used",
        "activation plus a residual",
        "SwiGLU gate",
        "sigmoid (no post-op)",
        "GELU with a wrong constant",
    ],
)
def test_outputs_that_are_not_one_activation_keep_a_plain_gemm(form, cache):
    activation = {
        "pre-activation also used": lambda m, x: (lambda h: F.gelu(h) * h.mean(-1, keepdim=True))(
            m.proj(x)
        ),
        "activation plus a residual": lambda m, x: (lambda h: h + F.gelu(h))(m.proj(x)),
        # SiLU feeding SwiGLU's product is computed inside the product's loop: no pass to save.
        "SwiGLU gate": lambda m, x: F.silu(m.proj(x)) * m.gate(x),
        "sigmoid (no post-op)": lambda m, x: torch.sigmoid(m.proj(x)),
        "GELU with a wrong constant": lambda m, x: (lambda h: 0.5 * h * (1 + torch.erf(h * 0.8)))(
            m.proj(x)
        ),
    }[form]
    out, expected, moved = _compile_head(activation, linear_kernel="onednn")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    plain = "oneDNN packed GEMM 24x48x64: oneDNN (linear_kernel=onednn)"
    assert moved and all(d.reason == plain for d in moved)  # SwiGLU: both linears, unfused


class SequenceTimer:
    """Fixed (candidate, baseline) times per measurement, in the order the pass asks for them."""

    def __init__(self, *times: tuple[float, float]) -> None:
        self.times = list(times)

    def __call__(self, calls):
        onednn_call, mkl_call = calls.values()
        torch.testing.assert_close(onednn_call(), mkl_call(), rtol=1e-4, atol=1e-4)
        return dict(zip(calls, self.times.pop(0), strict=True))


def test_fused_epilogue_must_beat_the_chosen_unfused_gemm_plus_the_activation(cache):
    """The plain GEMM is decided first; the fused form is then timed against that library's
    GEMM followed by the activation, and a fused form that is not faster leaves the plain
    choice in place."""
    gelu = ACTIVATION_FORMS["nn.GELU"][1]
    with use_timer(SequenceTimer((1.2e-3, 1.0e-3), (0.8e-3, 1.0e-3))):
        out, expected, moved = _compile_head(gelu)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert len(moved) == 1
    assert "+ gelu: oneDNN + gelu fused 800 us vs MKL, then gelu 1000 us" in moved[0].reason

    # Plain oneDNN faster, fusing not: the fused form is timed against oneDNN + the loop.
    shutil.rmtree(cache)  # the same shape: measure its plain GEMM again
    decisions.forget()
    relu = ACTIVATION_FORMS["relu"][1]
    timer = SequenceTimer((0.9e-3, 1.0e-3), (1.0e-3, 1.0e-3))
    with use_timer(timer):
        out, expected, moved = _compile_head(relu)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert not timer.times
    assert len(moved) == 1 and moved[0].reason.startswith("oneDNN packed GEMM 24x48x64: oneDNN 900")
    files = [json.loads(f.read_text())["fields"] for f in cache.glob("*.json")]
    fused = sorted((f["activation"], f["unfused"]) for f in files if "activation" in f)
    assert fused == [("relu", "oneDNN")] and len(files) == 2  # plain and fused, once each


def test_fused_epilogue_is_timed_against_the_loop_the_graph_will_run(cache):
    """With ``rational`` after ``linear_kernel`` (the default order) the unfused tanh-GELU is
    timed in its rational form, as the graph will run it; without that pass, as Inductor's own
    loop: two decisions, cached apart. (The timer checks both sides compute the same values.)"""
    gelu_tanh = ACTIVATION_FORMS["nn.GELU(tanh)"][1]
    for passes in (None, ("linear_kernel",)):
        mfusion.clear_report()
        with use_timer(SequenceTimer((1.2e-3, 1.0e-3), (1.2e-3, 1.0e-3))):
            out, expected, _ = _compile_head(gelu_tanh, passes=passes)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        # neither faster: the graph keeps MKL + the loop, whose tanh `rational` rewrites (the
        # measurement's own rewrite of the loop it timed stays out of the user's report)
        assert mfusion.report().rewritten("rational") == (1 if passes is None else 0)
    files = [json.loads(f.read_text())["fields"] for f in cache.glob("*.json")]
    loops = sorted(f["loop"] for f in files if "activation" in f)
    assert loops == ["inductor", "rational"]
