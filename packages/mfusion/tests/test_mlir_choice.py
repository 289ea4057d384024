"""The measured per-region choice: MLIR kernel vs Inductor's kernel for the same region, cached
per (region IR, pipeline, machine profile), and the whole-graph check that keeps the outlined
graph only if it is faster than the graph without its regions. Timers are injected: no outcome
depends on the speed of the machine running the tests (the injected timers still run both
sides once, so both compiled forms must work)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mfusion import MFusionConfig
from mfusion.autofuse.fuse import auto_fuse
from mfusion.mlir import choice, standalone
from mfusion.report import GraphReport
from npu_core.decisions import DecisionCache
from npu_core.timing import use_timer

REGION_OP = torch.ops.mfusion.mlir_region.default


def softmax_gelu(x, b):
    y = x + b
    g = 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))
    e = torch.exp(g - g.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


ARGS = (torch.randn(8, 128), torch.randn(128))


@pytest.fixture
def decisions(tmp_path, monkeypatch):
    """A private decision cache, measured mode."""
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MFUSION_MLIR_CHOICE", raising=False)
    return tmp_path / "mlir-choice"


def _fuse(harness, machine=None):
    gm = harness.trace(softmax_gelu, *ARGS)
    record = GraphReport(0, "mlir-cpu")
    outlined = auto_fuse(gm.graph, MFusionConfig(backend="mlir-cpu", machine=machine), record)
    gm.recompile()
    return gm, outlined, record


@pytest.mark.slow
def test_faster_region_is_outlined_cached_and_matches_eager(harness, decisions):
    timer = harness.fixed_timer(1e-6, 2e-6)
    # scoped to the MLIR choice: other measured decisions (more of them on some ISAs) keep theirs
    with (
        use_timer(timer, choice.REGION_NAMESPACE),
        use_timer(timer, choice.GRAPH_NAMESPACE),
    ):
        gm, outlined, record = _fuse(harness)
    assert outlined == 1 and timer.calls == 2  # the region, then the whole graph
    assert harness.count(gm, REGION_OP) == 1
    assert "mlir 1.0 us vs inductor 2.0 us" in record.regions[0].reason
    assert record.whole_graph.startswith("regions kept: with regions 0.001 ms vs without 0.002")
    [region] = decisions.glob("*.json")
    [whole] = (decisions.parent / choice.GRAPH_NAMESPACE).glob("*.json")
    assert json.loads(region.read_text())["choice"] == "mlir"
    assert json.loads(whole.read_text())["choice"] == "outlined"
    torch.testing.assert_close(gm(*ARGS), softmax_gelu(*ARGS), atol=1e-5, rtol=1e-5)

    # the same region again (a new trace): a cache hit, nothing measured
    with use_timer(harness.failing_timer):
        gm, outlined, record = _fuse(harness)
    assert outlined == 1 and "(ratio 0.50, cache)" in record.regions[0].reason
    assert record.whole_graph.endswith("(ratio 0.500, cache)")


@pytest.mark.slow
def test_slower_region_stays_with_inductor(harness, decisions):
    timer = harness.fixed_timer(3e-6, 2e-6)
    with use_timer(timer):
        gm, outlined, record = _fuse(harness)
    assert outlined == 0 and timer.calls == 1
    assert harness.count(gm, REGION_OP) == 0
    assert not record.regions[0].outlined
    assert record.regions[0].reason.startswith("stays with Inductor, inductor: mlir 3.0 us")
    torch.testing.assert_close(gm(*ARGS), softmax_gelu(*ARGS), atol=1e-6, rtol=1e-6)
    with use_timer(harness.failing_timer):  # the "no" is cached as well
        assert _fuse(harness)[1] == 0


@pytest.mark.slow
def test_another_machine_profile_measures_again(harness, decisions):
    timer = harness.fixed_timer(1e-6, 2e-6)
    avx2 = harness.machine("AVX2")
    with use_timer(timer):
        _fuse(harness, avx2)
        _fuse(harness, avx2)
        assert timer.calls == 2  # region and whole graph, once
        _fuse(harness, dataclasses.replace(avx2, threads=2))
    assert timer.calls == 4
    assert len(list(decisions.glob("*.json"))) == 2
    assert len(list((decisions.parent / choice.GRAPH_NAMESPACE).glob("*.json"))) == 2


@pytest.mark.slow
def test_slower_whole_graph_puts_the_regions_back_and_caches_that(harness, decisions):
    """A region faster alone, but the graph slower with it outlined: the region goes back into
    the graph for Inductor (same nodes, same result), the report says why, the "no" is cached."""
    region_timer, graph_timer = harness.fixed_timer(1e-6, 2e-6), harness.fixed_timer(3e-3, 2e-3)
    with use_timer(region_timer), use_timer(graph_timer, choice.GRAPH_NAMESPACE):
        gm, outlined, record = _fuse(harness)
    assert (region_timer.calls, graph_timer.calls) == (1, 1)
    assert outlined == 0 and harness.count(gm, REGION_OP) == 0
    summary = record.regions[0]
    assert not summary.outlined
    assert summary.reason.startswith("put back for Inductor by the whole-graph check;")
    assert record.whole_graph == (
        "regions put back for Inductor: with regions 3.000 ms vs without 2.000 ms "
        "(ratio 1.500, measured)"
    )
    plain = harness.trace(softmax_gelu, *ARGS)
    ops = sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert ops == sorted(str(n.target) for n in plain.graph.nodes if n.op == "call_function")
    torch.testing.assert_close(gm(*ARGS), softmax_gelu(*ARGS), atol=1e-6, rtol=1e-6)

    with use_timer(harness.failing_timer):
        gm, outlined, record = _fuse(harness)
    assert outlined == 0 and record.whole_graph.endswith("(ratio 1.500, cache)")


def test_graph_that_fails_to_compile_keeps_inductors_form(harness, decisions, monkeypatch):
    """If the whole graph cannot be compiled or run standalone, nothing is measured, nothing is
    cached, and the regions go back: the form known not to lose to Inductor."""

    def broken(gm, inputs):
        raise AssertionError("packed_w must be a graph constant")

    monkeypatch.setattr(standalone, "graph_kernel", broken)
    with use_timer(harness.fixed_timer(1e-6, 2e-6)):
        gm, outlined, record = _fuse(harness)
    assert outlined == 0 and harness.count(gm, REGION_OP) == 0
    assert record.whole_graph.startswith("regions put back: the graph did not compile or run")
    assert "packed_w must be a graph constant" in record.whole_graph
    assert not (decisions.parent / choice.GRAPH_NAMESPACE).exists()
    torch.testing.assert_close(gm(*ARGS), softmax_gelu(*ARGS), atol=1e-6, rtol=1e-6)


def test_whole_graph_check_times_symbolic_shapes_at_their_hints(harness):
    """A graph with symbolic sizes is timed at the sizes it was traced with; a placeholder that
    is neither a tensor nor a size cannot be made up."""
    static = harness.trace(softmax_gelu, *ARGS)
    assert standalone.timing_inputs_refusal(static) is None
    symbolic = harness.trace(softmax_gelu, *ARGS, mode="symbolic")
    assert standalone.has_symbolic_shapes(symbolic) and not standalone.has_symbolic_shapes(static)
    assert standalone.timing_inputs_refusal(symbolic) is None
    assert [t.shape for t in standalone.example_inputs(symbolic)] == [a.shape for a in ARGS]
    symbolic.graph.find_nodes(op="placeholder")[1].meta["val"] = 0.5
    assert "is not a tensor (float)" in str(standalone.timing_inputs_refusal(symbolic))


def test_whole_graph_signature_sees_shapes_and_structure(harness):
    a = standalone.graph_signature(harness.trace(softmax_gelu, *ARGS))
    assert a == standalone.graph_signature(harness.trace(softmax_gelu, *ARGS))
    wider = (torch.randn(8, 256), torch.randn(256))
    assert a != standalone.graph_signature(harness.trace(softmax_gelu, *wider))
    shifted = harness.trace(lambda x, b: softmax_gelu(x, b) + 1, *ARGS)
    assert a != standalone.graph_signature(shifted)


def test_region_decision_is_kept_per_profile_with_what_it_was_taken_for(tmp_path, harness):
    """decide() keys the region by IR hash, pipeline and the whole machine profile (torch
    included), and a second call with the same key reads the file without building anything."""
    machine = harness.machine("AVX2")
    cache = DecisionCache(tmp_path)
    gm = harness.trace(softmax_gelu, *ARGS)
    with use_timer(harness.fixed_timer(2e-6, 1e-6)):
        decision = choice.decide(gm, lambda inputs: None, "abc", "vector", machine, cache)
    assert not decision.use_mlir and decision.source == "measured"
    [path] = (tmp_path / choice.REGION_NAMESPACE).glob("*.json")
    record = json.loads(path.read_text())
    assert record["fields"] == {"region": "abc", "pipeline": "vector"}
    assert record["machine"]["cpu_model"] == "test AVX2" and record["machine"]["torch"]
    with use_timer(harness.failing_timer):
        again = choice.decide(None, None, "abc", "vector", machine, cache)
    assert again == dataclasses.replace(decision, source="cache")


def test_choice_override_and_refusal(harness, decisions, monkeypatch):
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "never")
    with use_timer(harness.failing_timer):
        _, outlined, record = _fuse(harness)
    assert outlined == 0 and "MFUSION_MLIR_CHOICE=never" in record.regions[0].reason
    assert not decisions.exists()
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")  # outlined without any timing
    with use_timer(harness.failing_timer):
        _, outlined, record = _fuse(harness)
    assert outlined == 1 and record.whole_graph == ""
    assert not decisions.exists()
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "sometimes")
    with pytest.raises(ValueError, match=r"MFUSION_MLIR_CHOICE='sometimes' is not known"):
        choice.choice_mode()


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path / "a"))
    assert choice.cache_dir() == tmp_path / "a" / "mlir-choice"
    monkeypatch.delenv("MFUSION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert choice.cache_dir() == tmp_path / "xdg" / "mfusion" / "mlir-choice"


@pytest.mark.slow
def test_inductor_stand_in_computes_the_region(harness):
    """The Inductor side of the comparison is the region compiled by Inductor: same result."""
    gm = harness.trace(softmax_gelu, *ARGS)
    inputs = standalone.example_inputs(gm)
    assert [t.shape for t in inputs] == [a.shape for a in ARGS]
    call = standalone.inductor_kernel(gm, inputs)
    torch.testing.assert_close(call(), softmax_gelu(*inputs), atol=1e-5, rtol=1e-5)
