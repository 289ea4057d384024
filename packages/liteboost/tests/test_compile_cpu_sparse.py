"""``torch.compile`` with the fused CPU sparse kernel: one graph, no break, eager's output.

The kernel, its shared-block split and the log-sum-exp merge are one custom operator
(``liteboost::fused_block_sparse_attention``); these tests hold it to the stock model's graph
count, to eager, to the dense-mask reference kernel, and to gradients that are right or refused.
"""

from __future__ import annotations

import pytest
import torch

import liteboost
from liteboost.ops.fused_cpu import fused_block_sparse_attention
from liteboost.ops.rain_fusion import SparseKernel, default_kernel
from liteboost.ops.sparse_attention import sparse_attention
from liteboost.tiny import build_tiny_transformer
from npu_core.plugins import PluginError

# Dynamo tracing, AOT autograd and (slow test) Inductor's C++ compile on a loaded two-core
# machine; the timeout only catches hangs.
pytestmark = pytest.mark.timeout(900)

# 3 x 4 x 4 = 48 tokens in blocks of 16: sparsity 0.5 keeps 2 of 3 key blocks per query block,
# frame 0's block in every row (a shared block, so the split-and-merge path runs).
BLOCK = 16
SPARSITY = 0.5
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def _operator_calls(graphs) -> int:
    target = torch.ops.liteboost.fused_block_sparse_attention.default
    return sum(node.target is target for graph in graphs for node in graph.graph.nodes)


def _boost(model, kernel=None):
    return liteboost.BoostManager(
        model, sparsity=SPARSITY, rope_cache=True, block_size=BLOCK, sparse_kernel=kernel
    )


def _qkv(seed: int = 0, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 64, 8, generator=gen).requires_grad_(requires_grad) for _ in "qkv"]


@pytest.mark.parametrize(
    "index",
    [
        [[0, 2], [0, 1], [0, 3], [0, -1]],  # block 0 in every row: the shared-block merge
        [[1, 2], [-1, 0], [3, -1], [-1, -1]],  # nothing shared, one row keeps nothing
    ],
    ids=["shared", "ragged"],
)
def test_operator_passes_torch_opcheck(index):
    """Schema, fake kernel (shapes, dtypes, strides), autograd registration and AOT dispatch
    agree with the real kernel (``torch.library.opcheck``), in fp32 and bf16."""
    block_index = torch.tensor(index, dtype=torch.int32).expand(1, 2, 4, 2).contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (t.to(dtype) for t in _qkv())
        args = (q, k, v, block_index, BLOCK, BLOCK, 0.3)
        results = torch.library.opcheck(fused_block_sparse_attention, args)
        assert set(results.values()) == {"SUCCESS"}, results


def test_backward_through_the_operator_raises():
    """No autograd formula: a backward through the operator itself fails loudly (the public
    kernel functions route autograd to block gather before reaching it)."""
    q, k, v = _qkv(requires_grad=True)
    index = torch.tensor([[0, 1]] * 4, dtype=torch.int32).expand(1, 2, 4, 2).contiguous()
    out, _ = fused_block_sparse_attention(q, k, v, index, BLOCK, BLOCK, 0.3)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


def test_boosted_sparse_transformer_traces_as_one_graph_like_stock(wan_inputs, explained):
    """With the CPU default kernel the boosted tiny Wan traces as stock does (one graph, no
    break), each self-attention one operator node; the fullgraph compile equals eager, which
    equals the dense-mask reference kernel and is really sparse (differs from dense)."""
    assert default_kernel(torch.device("cpu")) is SparseKernel.CPU
    model = build_tiny_transformer()
    inputs = wan_inputs(batch=2)
    stock = explained(model, inputs)
    assert (stock.graph_count, stock.graph_break_count) == (1, 0)
    with torch.no_grad():
        dense = model(**inputs).sample
    with _boost(model):
        with torch.no_grad():
            eager = model(**inputs).sample
        traced = explained(model, inputs)
        reasons = [str(r.reason).splitlines()[0] for r in traced.break_reasons]
        assert (traced.graph_count, traced.graph_break_count) == (1, 0), reasons
        assert _operator_calls(traced.graphs) == len(model.blocks)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            out = compiled(**inputs).sample
        torch._dynamo.reset()
    with _boost(model, kernel="reference"), torch.no_grad():
        reference = model(**inputs).sample
    torch.testing.assert_close(out, eager, **FP32)
    torch.testing.assert_close(eager, reference, **FP32)
    assert (eager - dense).abs().max() > 1e-3


@pytest.mark.slow
def test_inductor_fullgraph_compile_equals_eager(wan_inputs):
    """The real thing: Inductor compiles the boosted sparse transformer around the operator
    (``fullgraph=True``, so any break raises) and equals eager in fp32."""
    model = build_tiny_transformer()
    inputs = wan_inputs(batch=2)
    with _boost(model):
        with torch.no_grad():
            eager = model(**inputs).sample
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            out = compiled(**inputs).sample
        torch._dynamo.reset()
    torch.testing.assert_close(out, eager, **FP32)


def test_compile_under_autograd_gives_the_reference_gradients(qkv_factory):
    """Compiled with autograd recording, the chain picks the differentiable gather kernel (the
    fused one has no backward): output and gradients equal the eager reference kernel's. A
    forced ``cpu`` kernel is refused there, as in eager."""
    grid = (3, 4, 4)
    base = qkv_factory(grid, heads=2, dim=8)

    def attend(q, k, v, kernel=None):
        return sparse_attention(
            q, k, v, latent_shape=grid, sparsity=SPARSITY, block_size=BLOCK, kernel=kernel
        )

    results = []
    for fn in (torch.compile(attend, backend="aot_eager"), None):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = fn(q, k, v) if fn else attend(q, k, v, kernel="reference")
        out.square().sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    torch._dynamo.reset()
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    forced = torch.compile(lambda q, k, v: attend(q, k, v, kernel="cpu"), backend="aot_eager")
    with pytest.raises(PluginError, match="cpu"):
        forced(*(t.clone().requires_grad_() for t in base))
    torch._dynamo.reset()
