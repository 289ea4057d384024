"""CPU backend through torch-mlir: region -> torch dialect -> linalg -> LLVM, JIT-compiled.

The outlined call is ``torch.ops.mfusion.mlir_region(inputs, ir, out_spec)``: the region's
torch-backend IR travels in the graph as a string, so a graph loaded from Inductor's cache in a
new process recompiles it on first use. Regions are compiled at pass time too, so one that
torch-mlir cannot lower is declined (and stays with Inductor) instead of failing at run time.

Nothing here is tuned to one CPU: which regions are outlined depends on the capability table, on
whether torch-mlir lowers them and on a measurement against Inductor's kernel for the same region
on the machine the compile runs on (:mod:`mfusion.mlir.choice`, cached per region IR and machine
profile); the graph carries IR, not machine code. The LLVM JIT compiles for the CPU it runs on,
per process, so a cached graph moved to another CPU recompiles.

Regions are lowered with the ``vector`` pipeline (tiled, vectorised); IR it cannot lower falls back
to the ``scalar`` pipeline, and the measurement decides either way.
"""

from __future__ import annotations

import torch

from mfusion.autofuse.capability import MLIR_CPU_TABLE
from mfusion.autofuse.classify import RegionKind
from mfusion.autofuse.outline import OutlinedRegion
from mfusion.backends.base import KernelBackend, RegionCall
from mfusion.mlir.pipeline import PIPELINES, Pipeline

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
def mlir_region(
    inputs: list[torch.Tensor], ir: str, out_spec: str, pipeline: str = "vector"
) -> list[torch.Tensor]:
    """Run a JIT-compiled region; outputs are allocated here and filled by the kernel."""
    from mfusion.mlir.runtime import compiled_region

    outputs = [torch.empty(shape, dtype=dtype) for dtype, shape in parse_out_spec(out_spec)]
    compiled_region(ir, _pipeline(pipeline))(inputs, outputs)
    return outputs


@mlir_region.register_fake
def _mlir_region_fake(
    inputs: list[torch.Tensor], ir: str, out_spec: str, pipeline: str = "vector"
) -> list[torch.Tensor]:
    return [inputs[0].new_empty(shape, dtype=dtype) for dtype, shape in parse_out_spec(out_spec)]


def _pipeline(name: str) -> Pipeline:
    if name == "vector":
        return "vector"
    if name == "scalar":
        return "scalar"
    raise ValueError(f"pipeline={name!r} is not known; use one of {list(PIPELINES)}")


class MLIRCPUBackend(KernelBackend):
    name = "mlir-cpu"
    table = MLIR_CPU_TABLE
    last_note = "compiled by backend"
    """What decided the last outlined region (for the report)."""

    def compile_region(self, region: OutlinedRegion, kind: RegionKind) -> RegionCall | str:
        """Compile the region (vector pipeline, else scalar), then keep it only if it measures
        no slower than Inductor's kernel for it (:func:`mfusion.mlir.choice.decide`)."""
        from mfusion.machine import MachineProfile
        from mfusion.mlir.choice import decide
        from mfusion.mlir.importer import import_region
        from mfusion.mlir.runtime import CompiledRegion, compiled_region, region_key

        if not region.inputs:
            return "region has no tensor input"
        outputs = [o.meta["val"] for o in region.outputs]
        if any(v.dtype not in _NAMES for v in outputs):
            return "an output dtype has no JIT mapping"
        try:
            ir = import_region(region.module)
        except Exception as error:  # torch-mlir reports import failures as generic errors
            return f"torch-mlir could not import the region: {_first_line(error)}"
        compiled: CompiledRegion | None = None
        failures = []
        for pipeline in PIPELINES:
            try:
                compiled = compiled_region(ir, pipeline)
                break
            except Exception as error:  # lowering failures are generic errors too
                failures.append(f"{pipeline}: {_first_line(error)}")
        if compiled is None:
            return f"torch-mlir could not compile the region ({'; '.join(failures)})"
        spec = format_out_spec(outputs)
        kernel = compiled

        def run(inputs: list[torch.Tensor]) -> None:
            kernel(inputs, [torch.empty(s, dtype=d) for d, s in parse_out_spec(spec)])

        machine = self.machine if self.machine is not None else MachineProfile.detect()
        decision = decide(region.module, run, region_key(ir), compiled.pipeline, machine)
        self.last_note = f"compiled by backend; {decision.describe()}"
        if not decision.use_mlir:
            return f"stays with Inductor, {decision.describe()}"
        return torch.ops.mfusion.mlir_region.default, (ir, spec, compiled.pipeline)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:160]
