"""``torch.compile`` of the boosted Wan transformer on CUDA: no graph break where stock has none.

Issue item: cached real-arithmetic RoPE and liteboost's attention must keep the transformer
compilable. On CUDA the dense chain and the block-sparse path (FlexAttention, the CUDA default)
are traced with ``torch._dynamo.explain`` and their graph and break counts compared with the
stock model's; then the boosted model is compiled with Inductor (``fullgraph=True``, so a break
raises) and its output compared with the eager boosted output. The sparse output is also
compared with the dense masked reference kernel, so a compiled kernel that ignored the block
mask would fail.
"""

from __future__ import annotations

import pytest
import torch

import liteboost
from liteboost.ops.rain_fusion import SparseKernel, default_kernel
from liteboost.tiny import build_tiny_transformer
from npu_core.testing import requires_cuda

pytestmark = [pytest.mark.device, requires_cuda]

# Head dim 32 (the tiny config's 12 is not a power of two, which some FlexAttention releases
# refuse on CUDA); 3 x 8 x 8 = 192 tokens in 12 blocks of 16, so sparsity 0.5 skips blocks.
HEAD_DIM = 32
GRID = (3, 8, 8)
BLOCK = 16
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # fp32; Inductor may reorder sums


def _cuda_inputs(wan_inputs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    inputs = wan_inputs(grid=GRID, batch=2)
    return {
        name: t.to("cuda", dtype) if t.is_floating_point() else t.to("cuda")
        for name, t in inputs.items()
    }


def _graphs(model: torch.nn.Module, inputs: dict) -> tuple[int, int, list[str]]:
    """(graph count, graph break count, break reasons) of one traced forward."""
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(**inputs)
    reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    return explained.graph_count, explained.graph_break_count, reasons


@pytest.mark.parametrize(
    ("sparsity", "dtype"),
    [(0.0, torch.float32), (0.5, torch.float32)],
    ids=["dense-chain", "sparse-flex"],
)
def test_boosted_transformer_compiles_like_stock_on_cuda(
    sparsity, dtype, wan_inputs, record_property
):
    assert default_kernel(torch.device("cuda"), dtype) is SparseKernel.FLEX
    model = build_tiny_transformer(attention_head_dim=HEAD_DIM).to("cuda", dtype)
    inputs = _cuda_inputs(wan_inputs, dtype)
    stock_graphs, stock_breaks, _ = _graphs(model, inputs)
    with torch.no_grad():
        stock = model(**inputs).sample
    with liteboost.BoostManager(model, sparsity=sparsity, rope_cache=True, block_size=BLOCK):
        with torch.no_grad():
            eager = model(**inputs).sample  # fills the table cache, logs the kernel choice
        graphs, breaks, reasons = _graphs(model, inputs)
        record_property("stock_graphs_breaks", f"{stock_graphs}/{stock_breaks}")
        record_property("boosted_graphs_breaks", f"{graphs}/{breaks}")
        assert (graphs, breaks) == (stock_graphs, stock_breaks), reasons
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            out = compiled(**inputs).sample
        torch._dynamo.reset()
    reference_boost = liteboost.BoostManager(
        model, sparsity=sparsity, rope_cache=True, block_size=BLOCK, sparse_kernel="reference"
    )
    with reference_boost, torch.no_grad():
        reference = model(**inputs).sample
    assert stock_breaks == 0, "the stock tiny Wan is expected to compile without breaks"
    torch.testing.assert_close(out, eager, **TOLERANCE)
    torch.testing.assert_close(eager, reference, **TOLERANCE)
    if sparsity == 0.0:
        torch.testing.assert_close(eager, stock, **TOLERANCE)
    else:  # the sparse path really skipped blocks
        assert (eager - stock).abs().max() > 1e-3
