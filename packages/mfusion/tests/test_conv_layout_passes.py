"""conv_layout: convolutions whose weights are graph inputs stay NCHW where channels-last (with
its per-call weight conversions) measured slower, so Inductor no longer switches the graph.

Every decision here comes from an injected timer: no outcome depends on the test machine's
speed. The reference for numerics is the same graph without the pass (and eager)."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch._inductor.graph import GraphLowering

import mfusion
from mfusion import MFusionConfig
from mfusion.passes.conv_layout import CONVOLUTION, NCHW_CONVOLUTION, ConvShape
from mfusion.passes.manager import MFusionPassManager
from npu_core.timing import use_timer

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="Inductor picks channels-last with oneDNN only"
)


@pytest.fixture(autouse=True)
def _own_decision_cache(monkeypatch, tmp_path):
    """Each test starts with no cached layout decision."""
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))


class ConvNet(nn.Module):
    """Two convolutions (one transposed, one without bias) with an activation between them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(torch.relu(self.conv(x))).square().mean()


def _forward_graph(harness):
    """The aten graph of ConvNet's forward with its weights as inputs (as in a training step)."""
    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(2, 3, 8, 8)
    params = dict(model.named_parameters())

    def forward(params, x):
        return torch.func.functional_call(model, params, (x,))

    return harness.trace(forward, params, x), (params, x)


def _run(gm, is_inference=False, **options):
    config = MFusionConfig(passes=("conv_layout",), auto_fuse=False, **options)
    record = MFusionPassManager(config).run(gm.graph, is_inference=is_inference)
    gm.recompile()
    return record


def _count(gm, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == op)


def test_keeps_nchw_where_channels_last_measured_slower(harness):
    gm, inputs = _forward_graph(harness)
    expected = gm(*inputs)
    assert GraphLowering.decide_layout_opt(gm, is_inference=False), "Inductor would switch"
    # the timer runs both layouts' calls once and checks they compute the same weight gradient
    timer = harness.fixed_timer(1.0e-3, 2.0e-3, agree=True)
    with use_timer(timer):
        record = _run(gm, machine=harness.AVX2)
    assert timer.calls == 2  # one timing per distinct convolution
    assert _count(gm, CONVOLUTION) == 0 and _count(gm, NCHW_CONVOLUTION) == 2
    assert record.rewritten("conv_layout") == 2
    assert "kept NCHW" in record.decisions[0].reason and "ratio 0.50" in record.decisions[0].reason
    assert not GraphLowering.decide_layout_opt(gm, is_inference=False), "the graph stays NCHW"
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_channels_last_kept_on_a_tie_and_decisions_are_cached_per_machine(harness):
    gm, _ = _forward_graph(harness)
    with use_timer(harness.fixed_timer(0.99e-3, 1.0e-3)):  # within MIN_GAIN
        record = _run(gm, machine=harness.AVX2)
    assert _count(gm, CONVOLUTION) == 2 and record.rewritten("conv_layout") == 0
    assert len(record.refused("conv_layout")) == 2
    assert "channels-last kept" in record.decisions[0].reason
    again, _ = _forward_graph(harness)
    with use_timer(harness.failing_timer):  # same shapes, same machine: from the cache
        assert "cache" in _run(again, machine=harness.AVX2).decisions[0].reason
    other, _ = _forward_graph(harness)
    timer = harness.fixed_timer(1.0e-3, 2.0e-3)
    with use_timer(timer):  # another machine measures again
        assert _run(other, machine=harness.AVX512_BF16).rewritten("conv_layout") == 2
    assert timer.calls == 2


def test_inference_graphs_time_the_forward_only(harness, monkeypatch):
    gm, _ = _forward_graph(harness)
    seen = []
    original = ConvShape.calls

    def calls(self, backward):
        seen.append(backward)
        return original(self, backward)

    monkeypatch.setattr(ConvShape, "calls", calls)
    with use_timer(harness.fixed_timer(1.0e-3, 2.0e-3, agree=True)):
        assert _run(gm, is_inference=True, machine=harness.AVX2).rewritten("conv_layout") == 2
    assert seen == [False, False]


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ({"is_inference": None}, "whether a backward follows is unknown"),
        ({"conv_layout": "inductor"}, "conv_layout=inductor"),
        ({"frozen": True}, "frozen constant"),
    ],
)
def test_refusals_name_the_reason(harness, setup, reason):
    gm, _ = _forward_graph(harness)
    if setup.pop("frozen", False):
        first = next(n for n in gm.graph.nodes if n.target == CONVOLUTION)
        gm.register_buffer("frozen_weight", torch.randn(8, 3, 3, 3))
        with gm.graph.inserting_before(first):
            constant = gm.graph.get_attr("frozen_weight")
        constant.meta["val"] = first.args[1].meta["val"]
        first.replace_input_with(first.args[1], constant)
    is_inference = setup.pop("is_inference", False)
    with use_timer(harness.failing_timer):
        record = _run(gm, is_inference=is_inference, machine=harness.AVX2, **setup)
    assert _count(gm, CONVOLUTION) == 2 and len(record.refused("conv_layout")) == 2
    assert reason in record.decisions[0].reason


def test_forced_nchw_needs_no_timing_and_no_decision_where_inductor_keeps_nchw(harness):
    gm, _ = _forward_graph(harness)
    with use_timer(harness.failing_timer):
        assert _run(gm, conv_layout="nchw").rewritten("conv_layout") == 2
    gm, _ = _forward_graph(harness)
    with (
        inductor_config.patch(layout_optimization=False),
        use_timer(harness.failing_timer),
    ):
        record = _run(gm, machine=harness.AVX2)
    assert not record.decisions and _count(gm, CONVOLUTION) == 2


def test_compiled_training_step_keeps_nchw_and_equals_eager(harness):
    """Through torch.compile: Inductor tells the manager it compiles a training graph, the
    convolutions run as mfusion::convolution and loss and gradients equal eager."""
    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(2, 3, 8, 8)
    reference = ConvNet()
    reference.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    harness.step_equals_eager(
        model, reference, x, backend="inductor", passes=["conv_layout"], conv_layout="nchw"
    )
    assert mfusion.report().rewritten("conv_layout") == 2
