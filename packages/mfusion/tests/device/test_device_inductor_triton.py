"""mfusion under Inductor on CUDA: the passes fire, Triton kernels run, outputs equal eager."""

from __future__ import annotations

import math

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch._inductor.utils import run_and_get_code

import mfusion
from npu_core.bench import compare
from npu_core.testing import requires_cuda

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
EXPECTED_FP32 = ("rmsnorm", "swiglu", "layernorm", "gelu")


class _Block(nn.Module):
    """Hand-written RMSNorm -> SwiGLU MLP -> residual -> LayerNorm -> tanh-GELU, the spellings
    mfusion's passes recognise (as in the Llama, BERT and GPT-2 style models of its benchmark)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.ln_weight = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.ln_bias = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        a, b = self.gate(h), self.up(h)
        x = x + self.down(a * torch.sigmoid(a) * b)
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        y = (x - m) / torch.sqrt(v + 1e-5) * self.ln_weight + self.ln_bias
        c = math.sqrt(2 / math.pi)
        return 0.5 * y * (1 + torch.tanh(c * (y + 0.044715 * torch.pow(y, 3))))


def _triton_kernels(codes: list[str]) -> int:
    return sum(code.count("@triton.jit") for code in codes)


@pytest.mark.device
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mfusion_passes_fire_under_inductor_triton_and_match_eager(dtype, record_property):
    """One compiled CUDA graph: each pass rewrites its pattern (fp32), Inductor emits Triton
    kernels for the result, and the output equals eager; timings are recorded."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = _Block(1024, 2048).to(device, dtype).eval()
    x = torch.randn(8, 512, 1024, device=device, dtype=dtype)
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
        eager = model(x)
        torch._dynamo.reset()
        plain = torch.compile(model)
        _, plain_codes = run_and_get_code(plain, x)
        torch._dynamo.reset()
        fused = torch.compile(model, options=mfusion.compile_options(backend="inductor"))
        out, fused_codes = run_and_get_code(fused, x)

        assert out.device.type == "cuda" and out.dtype == dtype
        torch.testing.assert_close(out, eager, **TOLERANCE[dtype])
        assert _triton_kernels(fused_codes) > 0, "Inductor generated no Triton kernel"
        report = mfusion.report()
        assert len(report) == 1, str(report)
        graph = report[0]
        assert graph.backend == "inductor"
        if dtype == torch.float32:
            missing = [name for name in EXPECTED_FP32 if graph.rewritten(name) < 1]
            assert not missing, f"passes that did not fire: {missing}\n{report}"
        assert graph.rewritten() >= 1, str(report)

        vs_eager = compare(lambda: model(x), lambda: fused(x), warmup=3, repeats=20)
        vs_inductor = compare(lambda: plain(x), lambda: fused(x), warmup=3, repeats=20)
    numbers = {
        "rewrites": graph.rewritten(),
        "triton_kernels_inductor": _triton_kernels(plain_codes),
        "triton_kernels_mfusion": _triton_kernels(fused_codes),
        "eager_ms": round(1000 * vs_eager.baseline.median, 3),
        "inductor_ms": round(1000 * vs_inductor.baseline.median, 3),
        "mfusion_ms": round(1000 * vs_inductor.candidate.median, 3),
        "mfusion_over_inductor": round(vs_inductor.ratio_median, 3),
        "max_abs_error": f"{float((out.float() - eager.float()).abs().max()):.2e}",
    }
    for key, value in numbers.items():
        record_property(key, value)
    print(f"mfusion cuda {dtype}: {numbers}\n{report}")
