"""The whole-graph check on graphs whose inputs are not contiguous: a training step's backward
reads saved tensors in the layout the forward left them (the attention output saved as a
transposed view), and Inductor asserts every input's traced strides. The check's random inputs
must have those strides, else the graph with the outlined regions "failed to compile" and they
were put back. Timers are fixed: no outcome depends on the speed of the machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mfusion
from mfusion.autofuse.outline import snapshot
from mfusion.mlir import choice, standalone
from npu_core.decisions import DecisionCache
from npu_core.timing import use_timer


def test_example_inputs_have_the_placeholders_strides(harness):
    def fn(a, b, c):
        return (a.sum() + b.sum() + c.sum(),)

    transposed = torch.randn(6, 4).t()
    broadcast = torch.randn(5, 1).expand(5, 3)
    gm = harness.trace(fn, transposed, broadcast, torch.randn(2, 3))
    made = standalone.example_inputs(gm)
    for value, node in zip(made, gm.graph.find_nodes(op="placeholder"), strict=True):
        assert value.shape == node.meta["val"].shape
        assert value.stride() == node.meta["val"].stride()
        assert torch.isfinite(value).all() and value.std() > 0


def test_whole_graph_check_compiles_a_graph_with_a_transposed_input(harness, tmp_path):
    def fn(a, b):
        return (torch.relu(a) @ b + 1,)

    gm = harness.trace(fn, torch.randn(8, 16).t(), torch.randn(8, 4))
    cache = DecisionCache(tmp_path)
    with use_timer(harness.fixed_timer(1e-6, 2e-6), choice.GRAPH_NAMESPACE):
        decision = choice.decide_graph(snapshot(gm.graph), snapshot(gm.graph), harness.AVX2, cache)
    assert decision.use_mlir and decision.source == "measured"


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _DecoderLayer(nn.Module):
    """A Llama-shaped layer: RMSNorm, causal attention (its output saved for the backward as a
    transposed view), RMSNorm, SwiGLU MLP, residuals."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = _RMSNorm(dim), _RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = (
            t.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)
            for t in self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        )
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.out(attn.transpose(1, 2).reshape(batch, tokens, dim))
        y = self.mlp_norm(h)
        h = h + self.down(nn.functional.silu(self.gate(y)) * self.up(y))
        return h.square().mean()


def _placeholder_layouts_are_contiguous(gm: torch.fx.GraphModule) -> bool:
    values = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    return all(v.is_contiguous() for v in values if isinstance(v, torch.Tensor))


@pytest.mark.slow
@pytest.mark.timeout(900)  # two graphs of regions, each compiled by torch-mlir and Inductor
def test_training_step_keeps_backward_regions_through_the_whole_graph_check(
    harness, monkeypatch, tmp_path
):
    """Every region outlined (fixed region timer), every graph faster with them (fixed graph
    timer): the backward graph, whose inputs include non-contiguous saved tensors, must compile
    and run in the whole-graph check and keep its GEMM regions; loss and gradients equal eager."""
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path / "mfusion"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "measure")
    seen: list[bool] = []
    decide_graph = choice.decide_graph

    def recording(plain, outlined, machine, cache=None):
        seen.append(_placeholder_layouts_are_contiguous(plain))
        return decide_graph(plain, outlined, machine, cache)

    monkeypatch.setattr(choice, "decide_graph", recording)
    torch.manual_seed(0)
    model = _DecoderLayer(32, 4, 48)
    reference = _DecoderLayer(32, 4, 48)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 12, 32)
    torch._dynamo.reset()
    mfusion.clear_report()
    with (
        use_timer(harness.fixed_timer(1e-6, 2e-6)),
        use_timer(harness.fixed_timer(1e-6, 2e-6), choice.GRAPH_NAMESPACE),
    ):
        harness.step_equals_eager(model, reference, x, backend="mlir-cpu")
    graphs = mfusion.report().graphs
    assert False in seen  # the backward graph reads a saved tensor in a non-contiguous layout
    assert len(graphs) == 2
    for graph in graphs:
        assert graph.whole_graph.startswith("regions kept"), graph.whole_graph
        assert any(r.outlined and r.kind == "matmul" for r in graph.regions)
    torch._dynamo.reset()
