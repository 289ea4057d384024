"""Graphs of a GPU model, traced with fake CUDA tensors (no GPU needed, no kernel runs).

What mfusion decides for a CUDA graph is decided at trace time from the graph's metadata, so it
is checked here on every machine: the device-neutral passes rewrite the graph and leave a graph
that still runs on the device, the CPU-measured rewrites refuse naming the device, and the
``mlir-cpu`` backend (host code, CPU kernel only) leaves a GPU graph's regions to Inductor.
``tests/device`` runs the compiled result on a real GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mfusion import MFusionConfig
from mfusion.autofuse.fuse import auto_fuse
from mfusion.passes.manager import MFusionPassManager
from mfusion.report import GraphReport

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _fake_outputs(gm: torch.fx.GraphModule, device: str, *args: torch.Tensor) -> list:
    """Run ``gm`` on fake copies of ``args`` on ``device``: shapes, dtypes and devices only."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a).to(device) for a in args]
        out = gm(*fake)
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_passes_rewrite_a_cuda_graph_that_stays_on_the_device(
    harness, transformer_block, dtype
):
    torch.manual_seed(0)
    model = transformer_block(64, 128).to(dtype)
    names = [name for name, _ in model.named_parameters()]
    tensors = [p.detach() for _, p in model.named_parameters()]
    x = torch.randn(2, 16, 64, dtype=dtype)

    def forward(*args: torch.Tensor) -> torch.Tensor:
        params = dict(zip(names, args[:-1], strict=True))
        return torch.func.functional_call(model, params, (args[-1],))

    gm = harness.trace_on("cuda", forward, *tensors, x)
    before = _fake_outputs(gm, "cuda", *tensors, x)
    record = MFusionPassManager(MFusionConfig(backend="inductor")).run(gm.graph)
    gm.recompile()

    missing = [name for name in transformer_block.EXPECTED if record.rewritten(name) < 1]
    assert not missing, f"passes that did not rewrite the CUDA graph: {missing}\n{record.summary()}"
    after = _fake_outputs(gm, "cuda", *tensors, x)
    assert [(o.shape, o.dtype, o.device.type) for o in after] == [
        (o.shape, o.dtype, o.device.type) for o in before
    ]
    assert after[0].device.type == "cuda"


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """transformers' eager attention (matmul, scale, additive mask, fp32 softmax, matmul)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_attention_rewrite_is_cpu_only(harness, device, monkeypatch):
    """The flash rewrite was measured on CPU: the same graph on CUDA keeps its form (Inductor's
    own SDPA patterns and Triton handle it there) and the refusal names the device."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "fallback")  # on CPU, MIN_KEYS decides
    q, k, v = (torch.randn(1, 4, 512, 16) for _ in range(3))
    mask = torch.zeros(1, 1, 512, 512)
    gm = harness.trace_on(device, _attention, q, k, v, mask)
    record = MFusionPassManager(MFusionConfig(passes=("attention",), auto_fuse=False)).run(gm.graph)
    flash = harness.count(gm, FLASH)
    if device == "cpu":  # the positive control: the refusal below is the device's doing
        assert record.rewritten("attention") == 1 and flash == 1, record.summary()
    else:
        assert record.rewritten("attention") == 0 and flash == 0
        [refusal] = record.refused("attention")
        assert "device cuda" in refusal.reason and "CPU only" in refusal.reason


def test_mlir_cpu_leaves_a_cuda_graph_to_inductor(harness):
    """Regions the mlir-cpu table accepts on CPU are declined on CUDA, before any import or
    JIT compile, so a GPU graph compiled with ``backend="mlir-cpu"`` keeps its Triton path."""
    pytest.importorskip("torch_mlir.execution_engine")

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w) + 1.0

    gm = harness.trace_on("cuda", fn, torch.randn(8, 32), torch.randn(32))
    record = GraphReport(0, "mlir-cpu")
    assert auto_fuse(gm.graph, MFusionConfig(backend="mlir-cpu"), record) == 0
    assert record.regions, "the table planned no region: the check below would be vacuous"
    for region in record.regions:
        assert not region.outlined
        assert "region on cuda: mlir-cpu runs CPU tensors only" in region.reason
    assert not any(n.target is torch.ops.mfusion.mlir_region.default for n in gm.graph.nodes)
