"""Lowering pipelines: torch backend IR -> linalg on tensors -> LLVM dialect, for the CPU JIT."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_mlir import ir

# Bufferize with identity layouts at function boundaries and turn results into caller-provided
# out-parameters, so outputs are written straight into tensors torch allocated (no copies, no
# ownership hand-over); temporaries are freed by the ownership-based deallocation passes.
LLVM_PIPELINE = ",".join(
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


def lower_to_llvm(torch_backend_asm: str) -> ir.Module:
    """Parse torch backend IR, lower it to linalg and then to the LLVM dialect.

    Every public function gets ``llvm.emit_c_interface`` so the JIT exposes a
    ``_mlir_ciface_<name>`` entry taking memref descriptors.

    Raises:
        RuntimeError: A pipeline stage failed (the message carries torch-mlir's report).
    """
    from torch_mlir import ir
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report
    from torch_mlir.dialects import torch as torch_d

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
    run_pipeline_with_repro_report(
        module, f"builtin.module({LLVM_PIPELINE})", "Lowering Linalg-on-Tensors -> LLVM"
    )
    return module
