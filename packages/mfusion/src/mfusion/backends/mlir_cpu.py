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

import functools
from typing import TYPE_CHECKING, Any

import torch

from mfusion.autofuse.capability import MLIR_CPU_TABLE
from mfusion.autofuse.classify import RegionKind
from mfusion.autofuse.outline import OutlinedRegion
from mfusion.backends.base import KernelBackend, RegionCall
from mfusion.mlir.pipeline import PIPELINES, Pipeline

if TYPE_CHECKING:
    from mfusion.mlir.runtime import CompiledRegion

_DTYPES = {"f32": torch.float32, "f64": torch.float64}
_NAMES = {v: k for k, v in _DTYPES.items()}


InputDim = tuple[int, int]
"""``(input index, dim)``: an output dim whose size is read from an input at call time."""


def format_out_spec(values: list[torch.Tensor], inputs: list[torch.Tensor] | None = None) -> str:
    """``"f32:64x128;f32:128"``: dtype and shape of each output. A symbolic dim is written as
    ``i<input>.<dim>`` (``"f32:i0.0x768"``), the input dim with the same size, so one graph
    call allocates outputs for whatever sizes it is run with.

    Raises:
        ValueError: a symbolic output dim is no input's dim (a view's product of sizes).
    """
    items = []
    for value in values:
        dims = [str(d) if isinstance(d, int) else _input_dim(d, inputs or []) for d in value.shape]
        items.append(f"{_NAMES[value.dtype]}:{'x'.join(dims)}")
    return ";".join(items)


def _input_dim(dim: torch.SymInt, inputs: list[torch.Tensor]) -> str:
    """``i<input>.<dim>`` of the first input dim with the same symbolic size as ``dim``
    (compared as expressions: no guard is added to the compile's shape environment)."""
    for index, value in enumerate(inputs):
        for position, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt) and size.node.expr == dim.node.expr:
                return f"i{index}.{position}"
    raise ValueError(f"output dim {dim} is the size of no input dim")


@functools.lru_cache(maxsize=1024)
def parse_out_spec(spec: str) -> list[tuple[torch.dtype, list[int | InputDim]]]:
    parsed: list[tuple[torch.dtype, list[int | InputDim]]] = []
    for item in spec.split(";"):
        dtype, _, shape = item.partition(":")
        dims: list[int | InputDim] = []
        for dim in shape.split("x") if shape else []:
            if dim.startswith("i"):
                index, _, position = dim[1:].partition(".")
                dims.append((int(index), int(position)))
            else:
                dims.append(int(dim))
        parsed.append((_DTYPES[dtype], dims))
    return parsed


def output_shapes(spec: str, inputs: list[torch.Tensor]) -> list[tuple[torch.dtype, list[Any]]]:
    """Dtype and shape of each output for this call's ``inputs`` (sizes or SymInts)."""
    return [
        (dtype, [d if isinstance(d, int) else inputs[d[0]].shape[d[1]] for d in dims])
        for dtype, dims in parse_out_spec(spec)
    ]


# Registered through ``torch.library.Library`` + a CPU kernel rather than
# ``torch.library.custom_op``: the custom-op wrapper's own Python layers doubled the dispatch
# cost of every call (54 vs 27 us measured on the loaded 2-core machine), which small regions
# pay on each run. The op is never differentiated: it runs inside compiled graphs, whose
# autograd AOTAutograd handles around it.
# torch.library's registration API is not annotated: the ignores below are that, nothing else.
_LIB = torch.library.Library("mfusion", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "mlir_region(Tensor[] inputs, str ir, str out_spec, str pipeline='vector', "
    "str block_ir='', str split='') -> Tensor[]"
)


def mlir_region(
    inputs: list[torch.Tensor],
    ir: str,
    out_spec: str,
    pipeline: str = "vector",
    block_ir: str = "",
    split: str = "",
) -> list[torch.Tensor]:
    """Run a JIT-compiled region; outputs are allocated here (sizes from ``out_spec``, symbolic
    ones read from ``inputs``) and filled by the kernel.

    With ``block_ir`` (the region compiled for one block of rows; for a kernel with dynamic
    dims, the region's own IR) the rows run as blocks on threads; ``split`` is one flag per
    input (``1``: split with the rows, ``0``: passed whole), then ``:<number of blocks>`` (at
    most that many for a dynamic kernel, cut from this call's rows).
    """
    from mfusion.mlir.runtime import compiled_region, run_blocks

    outputs = [torch.empty(shape, dtype=dtype) for dtype, shape in output_shapes(out_spec, inputs)]
    if block_ir:
        flags, _, blocks = split.partition(":")
        kernel = compiled_region(block_ir, _pipeline(pipeline))
        run_blocks(kernel, inputs, outputs, [f == "1" for f in flags], int(blocks))
    else:
        compiled_region(ir, _pipeline(pipeline))(inputs, outputs)
    return outputs


_LIB.impl("mlir_region", mlir_region, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("mfusion::mlir_region", lib=_LIB)  # type: ignore[untyped-decorator]
def _mlir_region_fake(
    inputs: list[torch.Tensor],
    ir: str,
    out_spec: str,
    pipeline: str = "vector",
    block_ir: str = "",
    split: str = "",
) -> list[torch.Tensor]:
    return [
        inputs[0].new_empty(shape, dtype=dtype) for dtype, shape in output_shapes(out_spec, inputs)
    ]


def _pipeline(name: str) -> Pipeline:
    if name == "vector":
        return "vector"
    if name == "scalar":
        return "scalar"
    raise ValueError(f"pipeline={name!r} is not known; use one of {list(PIPELINES)}")


class MLIRCPUBackend(KernelBackend):
    name = "mlir-cpu"
    table = MLIR_CPU_TABLE
    whole_graph_check = True
    last_note = "compiled by backend"
    """What decided the last outlined region (for the report)."""

    def compile_region(self, region: OutlinedRegion, kind: RegionKind) -> RegionCall | str:
        """Compile the region (vector pipeline, else scalar), then keep it only if it measures
        no slower than Inductor's kernel for it (:func:`mfusion.mlir.choice.decide`)."""
        from mfusion.machine import MachineProfile
        from mfusion.mlir.choice import decide
        from mfusion.mlir.flatten import flatten_gemm_region
        from mfusion.mlir.importer import import_region
        from mfusion.mlir.runtime import compiled_region, region_key

        if not region.inputs:
            return "region has no tensor input"
        devices = _devices(region) - {"cpu"}
        if devices:
            # The JIT compiles host code and the op has a CPU kernel only: a region of a GPU
            # graph stays with Inductor (Triton) instead of failing when the graph runs.
            return f"region on {', '.join(sorted(devices))}: mlir-cpu runs CPU tensors only"
        scalars = [n.name for n in region.inputs if not isinstance(n.meta.get("val"), torch.Tensor)]
        if scalars:
            # a view of a dynamic shape reads its sizes from the graph (sym_size nodes); the
            # call takes tensors only
            return f"region reads the symbolic size {scalars[0]}: mlir-cpu passes tensors only"
        outputs = [o.meta["val"] for o in region.outputs]
        if any(v.dtype not in _NAMES for v in outputs):
            return "an output dtype has no JIT mapping"
        inputs = [n.meta["val"] for n in region.inputs]
        try:
            spec = format_out_spec(outputs, inputs)
        except ValueError as error:
            return f"{error}: mlir-cpu allocates outputs from the input sizes"
        module = region.module
        if kind is RegionKind.MATMUL:
            # 3-D views around the matmul keep the GEMM lowering off (scalar fallback)
            module = flatten_gemm_region(module) or module
        try:
            ir = import_region(module)
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
        machine = self.machine if self.machine is not None else MachineProfile.detect()
        block_ir, split = self._blocks(region, machine.threads, compiled)
        args = (ir, spec, compiled.pipeline, block_ir, split)

        def run(inputs: list[torch.Tensor]) -> None:
            torch.ops.mfusion.mlir_region.default(inputs, *args)

        key = region_key(ir + block_ir + split)
        decision = decide(region.module, run, key, compiled.pipeline, machine)
        threads = f", {split.partition(':')[2]} row blocks on threads" if block_ir else ""
        self.last_note = f"compiled by backend{threads}; {decision.describe()}"
        if not decision.use_mlir:
            return f"stays with Inductor, {decision.describe()}"
        return torch.ops.mfusion.mlir_region.default, args

    @staticmethod
    def _blocks(region: OutlinedRegion, threads: int, compiled: CompiledRegion) -> tuple[str, str]:
        """``(block_ir, split)`` for running the region on ``threads`` row blocks, or
        ``("", "")`` when its rows are not independent, do not divide evenly or threads is 1.

        A kernel with dynamic dims runs its blocks itself (any row count, cut per call): its
        ``block_ir`` is its own IR."""
        from mfusion.mlir.importer import import_region
        from mfusion.mlir.runtime import compiled_region
        from mfusion.mlir.threads import block_module, row_split, split_inputs

        rows = row_split(region.module) if threads > 1 else None
        if rows is None:
            return "", ""
        if compiled.dynamic:
            block_ir = compiled.ir
        elif not isinstance(rows, int) or rows % threads:
            return "", ""
        else:
            try:
                block_ir = import_region(block_module(region.module, rows, rows // threads))
                compiled_region(block_ir, compiled.pipeline)
            except Exception:  # a block that does not lower: run the whole region on one thread
                return "", ""
        flags = "".join("1" if f else "0" for f in split_inputs(region.module, rows))
        return block_ir, f"{flags}:{threads}"


def _devices(region: OutlinedRegion) -> set[str]:
    """Device types of the tensors the region reads and produces."""
    values = (node.meta.get("val") for node in (*region.inputs, *region.outputs))
    return {value.device.type for value in values if isinstance(value, torch.Tensor)}


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:160]
