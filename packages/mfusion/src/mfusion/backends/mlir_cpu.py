"""CPU backend through torch-mlir: region -> torch dialect -> linalg -> LLVM, JIT-compiled.

The outlined call is ``torch.ops.mfusion.mlir_region(inputs, ir, out_spec)``: the region's
torch-backend IR travels in the graph as a string, so a graph loaded from Inductor's cache in a
new process recompiles it on first use. Regions are compiled at pass time too, so one that
torch-mlir cannot lower is declined (and stays with Inductor) instead of failing at run time.

Nothing here is tuned to one CPU: which regions are outlined depends on the capability table and
on whether torch-mlir lowers them, and the graph carries IR, not machine code. The LLVM JIT
compiles for the CPU it runs on, per process, so a cached graph moved to another CPU recompiles.
"""

from __future__ import annotations

import torch

from mfusion.autofuse.capability import MLIR_CPU_TABLE
from mfusion.autofuse.classify import RegionKind
from mfusion.autofuse.outline import OutlinedRegion
from mfusion.backends.base import KernelBackend, RegionCall

_DTYPES = {"f32": torch.float32, "f64": torch.float64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def format_out_spec(values: list[torch.Tensor]) -> str:
    """``"f32:64x128;f32:128"``: dtype and static shape of each output."""
    return ";".join(f"{_NAMES[v.dtype]}:{'x'.join(map(str, v.shape))}" for v in values)


def parse_out_spec(spec: str) -> list[tuple[torch.dtype, list[int]]]:
    parsed = []
    for item in spec.split(";"):
        dtype, _, shape = item.partition(":")
        parsed.append((_DTYPES[dtype], [int(s) for s in shape.split("x")] if shape else []))
    return parsed


@torch.library.custom_op("mfusion::mlir_region", mutates_args=())
def mlir_region(inputs: list[torch.Tensor], ir: str, out_spec: str) -> list[torch.Tensor]:
    """Run a JIT-compiled region; outputs are allocated here and filled by the kernel."""
    from mfusion.mlir.runtime import compiled_region

    outputs = [torch.empty(shape, dtype=dtype) for dtype, shape in parse_out_spec(out_spec)]
    compiled_region(ir)(inputs, outputs)
    return outputs


@mlir_region.register_fake
def _mlir_region_fake(inputs: list[torch.Tensor], ir: str, out_spec: str) -> list[torch.Tensor]:
    return [inputs[0].new_empty(shape, dtype=dtype) for dtype, shape in parse_out_spec(out_spec)]


class MLIRCPUBackend(KernelBackend):
    name = "mlir-cpu"
    table = MLIR_CPU_TABLE

    def compile_region(self, region: OutlinedRegion, kind: RegionKind) -> RegionCall | str:
        from mfusion.mlir.importer import import_region
        from mfusion.mlir.runtime import compiled_region

        if not region.inputs:
            return "region has no tensor input"
        outputs = [o.meta["val"] for o in region.outputs]
        if any(v.dtype not in _NAMES for v in outputs):
            return "an output dtype has no JIT mapping"
        try:
            ir = import_region(region.module)
            compiled_region(ir)
        except Exception as error:  # torch-mlir reports lowering failures as generic errors
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else "error"
            return f"torch-mlir could not compile the region: {first_line[:160]}"
        return torch.ops.mfusion.mlir_region.default, (ir, format_out_spec(outputs))
