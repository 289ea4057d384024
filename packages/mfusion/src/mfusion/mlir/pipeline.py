"""Lowering pipelines: torch backend IR -> linalg on tensors -> LLVM dialect, for the CPU JIT.

Two pipelines, both measured per region class in ``benchmarks/mlir_regions.py``:

- ``vector`` (the default): element-wise producers fused, unit dims folded,
  ``math.exp``/``math.tanh``/``math.erf`` expanded into arithmetic, each returned op tiled by
  rows with its producers fused into the row loop, every ``linalg.generic`` then tiled to
  innermost pieces and vectorised with the transform dialect (:mod:`mfusion.mlir.vectorize`),
  bufferised, multi-reductions lowered to one ``vector.reduction`` per piece and translated
  with reassociating float reductions.
- ``scalar`` (0.3.1's pipeline): linalg straight to scalar loops; kept as the baseline the
  benchmark compares against and as a fallback for IR the vector pipeline rejects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch_mlir import ir

Pipeline = Literal["vector", "scalar"]
PIPELINES: tuple[Pipeline, ...] = ("vector", "scalar")

# Bufferize with identity layouts at function boundaries and turn results into caller-provided
# out-parameters, so outputs are written straight into tensors torch allocated (no copies, no
# ownership hand-over); temporaries are freed by the ownership-based deallocation passes.
SCALAR_PIPELINE = ",".join(
    [
        "func.func(linalg-generalize-named-ops)",
        "func.func(linalg-fuse-elementwise-ops)",
        "convert-shape-to-std",
        "one-shot-bufferize{bufferize-function-boundaries "
        "function-boundary-type-conversion=identity-layout-map}",
        "buffer-results-to-out-params{hoist-static-allocs modify-public-functions}",
        "func.func(ownership-based-buffer-deallocation)",
        "buffer-deallocation-simplification",
        "bufferization-lower-deallocations",
        "func.func(convert-linalg-to-loops)",
        "func.func(lower-affine)",
        "convert-scf-to-cf",
        "func.func(arith-expand)",
        "func.func(math-expand-ops)",
        "convert-math-to-funcs",
        "func.func(convert-math-to-llvm)",
        "convert-math-to-libm",
        "expand-strided-metadata",
        "lower-affine",
        "finalize-memref-to-llvm",
        "func.func(convert-arith-to-llvm)",
        "convert-func-to-llvm",
        "convert-cf-to-llvm",
        "reconcile-unrealized-casts",
    ]
)
LLVM_PIPELINE = SCALAR_PIPELINE  # 0.3.1's name

# After tiling and vectorisation (on tensors). Canonicalise + CSE right after bufferisation so the
# copies one-shot-bufferize leaves between a tile and the identical subview it came from become
# self-copies and fold away (a strided memref.copy would otherwise call the C runner library,
# which this JIT does not load).
VECTOR_PIPELINE = ",".join(
    [
        "convert-shape-to-std",
        "one-shot-bufferize{bufferize-function-boundaries "
        "function-boundary-type-conversion=identity-layout-map}",
        "func.func(canonicalize)",
        "func.func(cse)",
        "func.func(canonicalize)",
        # hoist-dynamic-allocs: an output with dynamic (symbolic outer) dims is written straight
        # into the caller's tensor too, not into a malloc'd buffer copied out afterwards
        "buffer-results-to-out-params{hoist-static-allocs hoist-dynamic-allocs "
        "modify-public-functions}",
        "func.func(buffer-loop-hoisting)",
        "func.func(ownership-based-buffer-deallocation)",
        "buffer-deallocation-simplification",
        "bufferization-lower-deallocations",
        "func.func(canonicalize)",
        "func.func(convert-linalg-to-loops)",
        "func.func(lower-vector-multi-reduction{lowering-strategy=inner-reduction})",
        "func.func(lower-affine)",
        "func.func(canonicalize)",
        "func.func(convert-vector-to-scf)",
        "convert-scf-to-cf",
        "func.func(arith-expand)",
        "func.func(math-expand-ops)",
        # math first: convert-math-to-libm scalarises vector ops it has no intrinsic for
        # (erf) into vector.extract/insert, which the vector conversion then lowers
        "convert-math-to-funcs",
        "func.func(convert-math-to-llvm)",
        "convert-math-to-libm",
        "convert-vector-to-llvm{reassociate-fp-reductions}",
        "expand-strided-metadata",
        "lower-affine",
        "finalize-memref-to-llvm",
        "func.func(convert-arith-to-llvm)",
        "convert-func-to-llvm",
        "convert-cf-to-llvm",
        "convert-ub-to-llvm",
        "reconcile-unrealized-casts",
    ]
)


def lower_to_llvm(torch_backend_asm: str, pipeline: Pipeline = "vector") -> ir.Module:
    """Parse torch backend IR, lower it to linalg and then to the LLVM dialect.

    Args:
        torch_backend_asm: The region as torch backend IR (``import_region``'s result).
        pipeline: ``"vector"`` (tiled and vectorised) or ``"scalar"`` (plain loops).

    Every public function gets ``llvm.emit_c_interface`` so the JIT exposes a
    ``_mlir_ciface_<name>`` entry taking memref descriptors.

    Raises:
        RuntimeError: A pipeline stage failed (the message carries torch-mlir's report).
    """
    from torch_mlir import ir
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report
    from torch_mlir.dialects import torch as torch_d

    from mfusion.mlir.gemm import has_matmul
    from mfusion.mlir.vectorize import (
        expand_transcendentals,
        fold_empty_slices,
        fuse_rows,
        tile_and_vectorize,
    )

    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r} is not known; use one of {list(PIPELINES)}")
    context = ir.Context()
    torch_d.register_dialect(context)
    module = ir.Module.parse(torch_backend_asm, context)
    run_pipeline_with_repro_report(
        module,
        "builtin.module(torch-backend-to-linalg-on-tensors-backend-pipeline)",
        "Lowering Torch Backend IR -> Linalg-on-Tensors",
    )
    with context:
        for op in module.body.operations:
            op.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
    if pipeline == "scalar":
        run_pipeline_with_repro_report(
            module, f"builtin.module({SCALAR_PIPELINE})", "Lowering Linalg-on-Tensors -> LLVM"
        )
        return module
    if has_matmul(module):
        _lower_gemm(module)
        return module
    # Unit dims folded first: torch-mlir writes keepdim reductions with a constant 0 in the
    # output map, which tiling (and so row fusion) cannot handle.
    run_pipeline_with_repro_report(
        module,
        "builtin.module(func.func(linalg-generalize-named-ops),"
        "func.func(linalg-fuse-elementwise-ops),func.func(canonicalize),"
        "func.func(linalg-fold-unit-extent-dims),func.func(canonicalize))",
        "Fusing linalg element-wise ops",
    )
    expand_transcendentals(module)
    fuse_rows(module)
    run_pipeline_with_repro_report(
        module, "builtin.module(func.func(canonicalize),func.func(cse))", "Cleaning up row loops"
    )
    fold_empty_slices(module)
    tile_and_vectorize(module)
    run_pipeline_with_repro_report(
        module, f"builtin.module({VECTOR_PIPELINE})", "Lowering vectorised linalg -> LLVM"
    )
    return module


# A GEMM region's transposes and accumulators are 2-D vectors: unrolled to 1-D here, where the
# default lowering would put a stack buffer per loop iteration (and overflow the stack over K).
# A bare matmul (no epilogue) writes its accumulator into a tile of a fresh tensor that is then
# inserted into the output: eliminate-empty-tensors makes that tile a view of the output, so the
# write goes there directly (no copy through the C runner's memrefCopy, which is not loaded).
GEMM_PIPELINE = VECTOR_PIPELINE.replace(
    "func.func(convert-vector-to-scf)", "func.func(convert-vector-to-scf{full-unroll=true})"
).replace("one-shot-bufferize{", "eliminate-empty-tensors,one-shot-bufferize{", 1)


def _lower_gemm(module: ir.Module) -> None:
    """Matmul + epilogue regions (:mod:`mfusion.mlir.gemm`): the matmul and transpose stay named
    ops (their tiling needs them), the epilogue is fused into one generic and tiled with them."""
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report

    from mfusion.mlir.gemm import tile_matmul_epilogue
    from mfusion.mlir.vectorize import expand_transcendentals

    run_pipeline_with_repro_report(
        module,
        "builtin.module(func.func(linalg-fuse-elementwise-ops),func.func(canonicalize))",
        "Fusing the GEMM epilogue",
    )
    expand_transcendentals(module)
    tile_matmul_epilogue(module)
    run_pipeline_with_repro_report(
        module,
        f"builtin.module(func.func(canonicalize),func.func(cse),{GEMM_PIPELINE})",
        "Lowering the tiled GEMM -> LLVM",
    )
