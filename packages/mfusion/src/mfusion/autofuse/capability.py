"""Capability tables: which ops, dtypes and shapes a kernel backend can take into a fused region.

Tables are data. A backend's table is consulted node by node; a node it refuses stays outside
every region (and therefore with Inductor), with the reason recorded for the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import fx

from mfusion.autofuse.classify import RegionKind
from mfusion.passes._graph import CONVERT, aten, tensor_val

ELEMENTWISE_OPS = (
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.neg.default,
    aten.exp.default,
    aten.tanh.default,
    aten.erf.default,
    aten.sigmoid.default,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.relu.default,
    aten.pow.Tensor_Scalar,
    aten.where.self,
    aten.maximum.default,
    aten.minimum.default,
    CONVERT,
)
REDUCE_OPS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default)
RESHAPE_OPS = (
    aten.view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.expand.default,
)
MATMUL_OPS = (aten.mm.default, aten.bmm.default, aten.addmm.default)


@dataclasses.dataclass(frozen=True)
class OpCapability:
    """What a backend accepts for one op."""

    kind: RegionKind
    dtypes: frozenset[torch.dtype]
    max_rank: int = 6
    max_numel: int | None = None
    static_shapes: bool = False
    static_inner_dim: bool = False
    """Symbolic dims are accepted except in the innermost (last) dim: kernels loop over outer
    dims with dynamic bounds and vectorise a static row (``static_shapes`` overrides it)."""
    symbolic_rows_only: bool = False
    """A matmul whose row count M alone may be symbolic (dim 0 of the output and of the left
    operand): row blocks run to a dynamic bound, while K and N, which the packed weight panels
    are cut from, stay static (the right operand, the op's last argument, is all static)."""


class ShapeRefusal(str):
    """A refusal for a shape the backend cannot compile (a symbolic dim where it needs a static
    one): reported per graph, since the user can act on it (a static size, ``dynamic=False``);
    other refusals (an op or dtype outside the table) are the table working as intended.

    ``dim`` names the offending dim (``s0``): the nodes refused for one dim are one report line.
    """

    dim: str

    def __new__(cls, reason: str, dim: object) -> ShapeRefusal:
        refusal = super().__new__(cls, reason)
        refusal.dim = str(dim)
        return refusal


def _symbolic_dim(shape: tuple[object, ...], inner_only: bool) -> tuple[int, object] | None:
    """The first symbolic dim of ``shape`` (only the last dim when ``inner_only``)."""
    dims = list(enumerate(shape))[-1:] if inner_only else list(enumerate(shape))
    return next(((i, d) for i, d in dims if not isinstance(d, int)), None)


@dataclasses.dataclass(frozen=True)
class CapabilityTable:
    """The ops one backend can fuse, with per-op dtype and shape limits."""

    backend: str
    ops: Mapping[object, OpCapability]
    matmul_epilogue_only: bool = True
    """A matmul may lead a region (followed by elementwise epilogue), never sit behind a reduce."""

    def check(self, node: fx.Node) -> OpCapability | str:
        """The capability for ``node``, or why this backend cannot take it."""
        if node.op != "call_function":
            return "not an op call"
        cap = self.ops.get(node.target)
        if cap is None:
            return f"{node.target} is not in the {self.backend} capability table"
        out = tensor_val(node)
        if out is None:
            return "no tensor metadata"
        values = [out] + [v for v in map(tensor_val, node.all_input_nodes) if v is not None]
        for value in values:
            if value.dtype not in cap.dtypes:
                return f"dtype {value.dtype} not supported by {self.backend} for {node.target}"
            if value.dim() > cap.max_rank:
                return f"rank {value.dim()} above {self.backend}'s limit {cap.max_rank}"
            static = all(isinstance(s, int) for s in value.shape)
            if cap.symbolic_rows_only and not static:
                refusal = _symbolic_k_or_n(self.backend, node, value, value is out)
                if refusal is not None:
                    return refusal
            elif (cap.static_shapes or cap.static_inner_dim) and not static:
                found = _symbolic_dim(tuple(value.shape), inner_only=not cap.static_shapes)
                if found is not None:
                    index, dim = found
                    where = "symbolic dim" if cap.static_shapes else "symbolic inner dim"
                    needs = (
                        f"{self.backend} compiles {cap.kind.value} ops for static shapes only"
                        if cap.static_shapes
                        else f"{self.backend} vectorises a static innermost dim"
                    )
                    return ShapeRefusal(
                        f"{where} {dim} (dim {index}) of {node.name}'s "
                        f"{'output' if value is out else 'input'} {_shape(value)}: {needs}",
                        dim,
                    )
            if cap.max_numel is not None and static and value.numel() > cap.max_numel:
                return f"{value.numel()} elements above {self.backend}'s limit {cap.max_numel}"
        return cap


def _symbolic_k_or_n(
    backend: str, node: fx.Node, value: torch.Tensor, is_output: bool
) -> ShapeRefusal | None:
    """A refusal naming a symbolic K or N of a matmul (any symbolic dim of its right operand, a
    symbolic dim other than dim 0 elsewhere), or None when only the row count is symbolic."""
    right = node.args[-1]
    rows_may_vary = is_output or not (isinstance(right, fx.Node) and tensor_val(right) is value)
    dims = list(enumerate(value.shape))[1 if rows_may_vary else 0 :]
    found = next(((i, d) for i, d in dims if not isinstance(d, int)), None)
    if found is None:
        return None
    index, dim = found
    return ShapeRefusal(
        f"symbolic dim {dim} (dim {index}) of {node.name}'s "
        f"{'output' if is_output else 'input'} {_shape(value)}: "
        f"{backend} compiles matmul ops with a static K and N",
        dim,
    )


def _shape(value: torch.Tensor) -> str:
    return f"({', '.join(map(str, value.shape))})"


def _table(
    backend: str,
    groups: Mapping[RegionKind, tuple[object, ...]],
    dtypes: frozenset[torch.dtype],
    *,
    max_rank: int = 6,
    max_numel: int | None = None,
    static_shapes: bool | frozenset[RegionKind] = False,
    static_inner_dim: bool = False,
    symbolic_rows_only: frozenset[RegionKind] = frozenset(),
) -> CapabilityTable:
    """``static_shapes``: True for every op, or the kinds whose ops need static shapes;
    ``symbolic_rows_only``: the (matmul) kinds that take a symbolic row count only."""

    def static(kind: RegionKind) -> bool:
        return static_shapes if isinstance(static_shapes, bool) else kind in static_shapes

    ops = {
        op: OpCapability(
            kind,
            dtypes,
            max_rank,
            max_numel,
            static(kind),
            static_inner_dim,
            kind in symbolic_rows_only,
        )
        for kind, group in groups.items()
        for op in group
    }
    return CapabilityTable(backend, ops)


FLOATS = frozenset({torch.float32, torch.bfloat16, torch.float16})
ALL_KINDS = {
    RegionKind.ELEMENTWISE: ELEMENTWISE_OPS,
    RegionKind.REDUCE: REDUCE_OPS,
    RegionKind.RESHAPE: RESHAPE_OPS,
    RegionKind.MATMUL: MATMUL_OPS,
}

INDUCTOR_TABLE = _table("inductor", ALL_KINDS, FLOATS | {torch.float64})
# The JIT's vector pipeline tiles and vectorises rows (element-wise, reductions, softmax, norms)
# and, since 0.3.4, one 2-D matmul (mm / addmm) with its element-wise epilogue
# (mfusion.mlir.gemm: packed panels, register blocks, epilogue in the tile). No bmm: the GEMM
# strategy is 2-D. Matmul regions take a symbolic row count M (tokens: full 4-row blocks to a
# dynamic bound, the M mod 4 rest in 1-row blocks) but need a static K and N (the packed weight
# panels and the N panels are cut from them); row regions take symbolic outer dims (one kernel
# for every size, rows looped to dynamic bounds) but need a static innermost dim, the row they
# vectorise. max_numel bounds what one kernel is handed (64 MiB of fp32 per tensor): a size
# guard, not a measured speed threshold; whether a region pays (a GEMM against Inductor's BLAS
# call) is measured per region (mfusion.mlir.choice).
MLIR_CPU_MATMUL_OPS = (aten.mm.default, aten.addmm.default)
MLIR_CPU_TABLE = _table(
    "mlir-cpu",
    {
        **{k: v for k, v in ALL_KINDS.items() if k is not RegionKind.MATMUL},
        RegionKind.MATMUL: MLIR_CPU_MATMUL_OPS,
    },
    frozenset({torch.float32}),
    max_numel=1 << 24,
    static_inner_dim=True,
    symbolic_rows_only=frozenset({RegionKind.MATMUL}),
)
NPU_TABLE = _table("npu", ALL_KINDS, FLOATS, max_rank=8)
