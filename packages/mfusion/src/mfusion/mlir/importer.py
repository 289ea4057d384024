"""FX region -> MLIR torch dialect (value semantics) with torch_mlir's FxImporter."""

from __future__ import annotations

from torch import fx

REGION_FUNC = "region"


def import_region(gm: fx.GraphModule, *, symbolic: bool = False) -> str:
    """Import a functional aten graph into the torch backend contract and return its assembly.

    Placeholders and nodes must carry ``meta["val"]`` (fake tensors), as post-grad graphs do.
    The result has been through ``torchdynamo-export-to-torch-backend-pipeline``: value-semantic
    ``torch.aten.*`` ops with refined shapes, ready for :func:`mfusion.mlir.pipeline.lower`.

    Args:
        gm: The region, outlined as a stateless graph module returning a tuple.
        symbolic: Import symbolic shape expressions (dynamic dims) instead of requiring static.

    Raises:
        RuntimeError: torch-mlir could not import or legalise an op of the region.
    """
    from torch_mlir import ir
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter

    context = ir.Context()
    torch_d.register_dialect(context)
    importer = FxImporter(context=context)
    importer.import_stateless_graph(
        gm.graph, func_name=REGION_FUNC, import_symbolic_shape_expressions=symbolic
    )
    module = importer.module
    run_pipeline_with_repro_report(
        module,
        "builtin.module(torchdynamo-export-to-torch-backend-pipeline)",
        "Lowering region FX IR -> Torch Backend IR",
    )
    return str(module)
