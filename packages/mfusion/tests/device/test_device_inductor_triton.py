"""mfusion under Inductor on CUDA: the passes fire, Triton kernels run, outputs are as accurate
as eager's.

Accuracy is judged against a float64 evaluation of the same block on the device: the compiled
result may be no further from it than a small multiple of eager's own error in that dtype (or a
floor), so bf16 rounding, which is not the compiler's fault, does not fail the test, and a
rewrite that changes the maths does.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

import mfusion
from npu_core.bench import compare
from npu_core.testing import requires_cuda

FLOOR = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
"""Smallest bound on the max abs error (outputs are O(1) after the LayerNorm)."""
EAGER_FACTOR = 4
"""How many times eager's own error the compiled result may have."""


def _triton_kernels(codes: list[str]) -> int:
    return sum(code.count("@triton.jit") for code in codes)


def _max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max())


@pytest.mark.device
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mfusion_passes_fire_under_inductor_triton_and_match_eager(
    dtype, transformer_block, record_property
):
    """One compiled CUDA graph: each pass rewrites its pattern, Inductor emits Triton kernels for
    the result, and the output is as accurate as eager's; timings are recorded."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    reference_model = transformer_block(1024, 2048).to(device, torch.float64).eval()
    model = transformer_block(1024, 2048).to(device, dtype).eval()
    model.load_state_dict(reference_model.state_dict())  # cast to dtype on load
    x = torch.randn(8, 512, 1024, device=device, dtype=dtype)
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
        reference = reference_model(x.double())
        eager = model(x)
        torch._dynamo.reset()
        plain = torch.compile(model)
        _, plain_codes = run_and_get_code(plain, x)
        torch._dynamo.reset()
        mfusion.clear_report()
        fused = torch.compile(model, options=mfusion.compile_options(backend="inductor"))
        out, fused_codes = run_and_get_code(fused, x)

        assert out.device.type == "cuda" and out.dtype == dtype
        eager_error, fused_error = _max_error(eager, reference), _max_error(out, reference)
        bound = max(EAGER_FACTOR * eager_error, FLOOR[dtype])
        assert fused_error <= bound, (
            f"max error {fused_error:.3g} > bound {bound:.3g} (eager's {eager_error:.3g})"
        )
        assert _triton_kernels(fused_codes) > 0, "Inductor generated no Triton kernel"
        report = mfusion.report()
        assert len(report) == 1, str(report)
        graph = report[0]
        assert graph.backend == "inductor"
        # The same passes rewrite this block's CUDA graph in both dtypes (decided at trace time,
        # checked without a GPU in test_cuda_graphs.py).
        missing = [name for name in transformer_block.EXPECTED if graph.rewritten(name) < 1]
        assert not missing, f"passes that did not fire: {missing}\n{report}"

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
        "max_abs_error_mfusion": f"{fused_error:.2e}",
        "max_abs_error_eager": f"{eager_error:.2e}",
    }
    for key, value in numbers.items():
        record_property(key, value)
    print(f"mfusion cuda {dtype}: {numbers}\n{report}")
