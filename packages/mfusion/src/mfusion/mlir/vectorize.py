"""Tiling and vectorisation of linalg-on-tensors for the CPU JIT (the ``vector`` pipeline).

torch-mlir's linalg lowered straight to loops gives scalar code: LLVM's loop vectoriser does not
reassociate float reductions, and ``math.exp``/``math.tanh`` become one libm call per element.
Here each ``linalg.generic`` is tiled to innermost rows (every loop but the innermost gets
tile size 1; the innermost is cut into :data:`MAX_VECTOR`-element pieces or a divisor of it)
and then vectorised with the transform dialect (``transform.structured.tile_using_for`` +
``transform.structured.vectorize``), so each piece is one vector computation and a row
reduction is one ``vector.reduction`` per piece (lowered with reassociation: a tree of vector
ops, not a serial chain).

``math.exp``, ``math.tanh`` and ``math.erf`` on f32 are first rewritten into arithmetic
(Cephes-style range reduction and polynomial for exp, exp-based tanh with a Taylor branch near
0, Eigen's rational erf) so they vectorise too; this installed MLIR does not register
``math-polynomial-approximation``. Other functions stay libm calls, scalarised inside the
vector code (slow: such regions measure slower and stay with Inductor, see
:mod:`mfusion.mlir.choice`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_mlir import ir

MAX_VECTOR = 64
"""Longest innermost vector (elements) one tile computes: four AVX-512 (eight AVX2) registers of
f32. Longer vectors spill: on the AVX-512 CPU softmax/GELU/LayerNorm rows of 1024 measured
1.5-2x slower with whole-row vectors (1024) and 1.2-1.5x with 128-256; 32 was slower again
(loop overhead). Longer rows are tiled by a divisor; a reduction row then accumulates per tile."""

WHOLE_ROW = 128
"""Element-wise rows up to this length stay one vector: cutting a 128-row into two 64-pieces
made a fused softmax 1.5-1.7x slower (loop overhead per row), while 3072-rows wanted 64-pieces."""

MAX_REDUCTION = 512
"""Longest innermost reduction row kept whole. A reduction split into tiles carries its
accumulator through memory from tile to tile; on the AVX-512 CPU a fused softmax over rows of
128 took 1.7x longer with 64-element tiles than with whole rows, while element-wise ops want
the short :data:`MAX_VECTOR` pieces."""

MIN_VECTOR = 16
"""A row longer than :data:`MAX_VECTOR` is tiled by its largest divisor <= MAX_VECTOR that is a
multiple of this (one AVX-512 register of f32); without one the op stays scalar loops."""

TILE_ATTR = "mfusion_tile"

# Cephes expf: exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (in two parts).
_EXP_HI = 88.72283935546875  # above: +inf
_EXP_LO = -103.97208404541016  # below: 0
_LOG2E = 1.44269504088896341
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1)
_EXP_HALF = 5.0000001201e-1
# erf: odd/even rational approximation on [-4, 4] (Eigen's and XLA's float erf), +-1 beyond.
_ERF_CLAMP = 4.0
_ERF_NUM = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_DEN = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)
# tanh: odd Taylor polynomial below this |x| (no cancellation), exp form above it.
_TANH_SMALL = 0.0625
_TANH_TAYLOR = (-1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0)


def loop_ranges(op: ir.Operation) -> list[int | None]:
    """Static trip count of each loop of a ``linalg.generic`` (None where no operand fixes it)."""
    from torch_mlir import ir

    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    ranges: list[int | None] = [None] * maps[0].n_dims
    for operand, amap in zip(op.operands, maps, strict=False):
        value_type = operand.type.maybe_downcast()
        if not isinstance(value_type, ir.ShapedType) or not value_type.has_rank:
            continue
        shape = value_type.shape
        for j, expr in enumerate(amap.results):
            dim = expr.maybe_downcast()
            if isinstance(dim, ir.AffineDimExpr) and shape[j] >= 0:
                ranges[dim.position] = shape[j]
    return ranges


def tile_sizes(ranges: list[int | None], reduction: bool = False) -> list[int] | None:
    """Tile sizes for one op (0 = untiled), or None to leave it to scalar loops.

    Every loop but the innermost is tiled by 1, so one tile is one innermost row whatever the
    outer trip counts are (dynamic outer dims, ``None`` in ``ranges``, loop with dynamic bounds
    and leave the tile static); only the innermost range must be static. The row is
    kept whole up to :data:`WHOLE_ROW` elements (:data:`MAX_REDUCTION` when the innermost loop
    is a reduction), else tiled by the largest multiple of :data:`MIN_VECTOR` dividing it and
    at most :data:`MAX_VECTOR` (:data:`MAX_REDUCTION`); a reduction row then accumulates tile
    by tile.
    """
    if not ranges or ranges[-1] is None:
        return None
    last = ranges[-1]
    limit = MAX_REDUCTION if reduction else MAX_VECTOR
    if last <= (MAX_REDUCTION if reduction else WHOLE_ROW):
        inner = 0
    else:
        divisors = [d for d in range(MIN_VECTOR, limit + 1, MIN_VECTOR) if last % d == 0]
        if not divisors:
            return None
        inner = max(divisors)
    return [1] * (len(ranges) - 1) + [inner]


def transform_script(plans: list[tuple[int, list[int]]]) -> str:
    """The transform-dialect sequence tiling and vectorising each tagged op."""
    lines = [
        "module attributes {transform.with_named_sequence} {",
        "transform.named_sequence @__transform_main("
        "%root: !transform.any_op {transform.readonly}) {",
    ]
    for index, sizes in plans:
        lines.append(
            f"%m{index} = transform.structured.match attributes {{{TILE_ATTR} = {index} : i64}} "
            "in %root : (!transform.any_op) -> !transform.any_op"
        )
        tiled = sum(1 for s in sizes if s)
        target = f"%m{index}"
        if tiled:
            loops = ", ".join(["!transform.any_op"] * tiled)
            lines.append(
                f"%t{index}, %l{index}:{tiled} = transform.structured.tile_using_for "
                f"%m{index} tile_sizes {sizes} "
                f": (!transform.any_op) -> (!transform.any_op, {loops})"
            )
            target = f"%t{index}"
        lines.append(f"transform.structured.vectorize {target} : !transform.any_op")
    lines += [
        '%f = transform.structured.match ops{["func.func"]} in %root '
        ": (!transform.any_op) -> !transform.any_op",
        "transform.apply_patterns to %f {",
        "  transform.apply_patterns.vector.cast_away_vector_leading_one_dim",
        "  transform.apply_patterns.vector.transfer_permutation_patterns",
        "  transform.apply_patterns.canonicalization",
        "} : !transform.any_op",
        "transform.yield",
        "}",
        "}",
    ]
    return "\n".join(lines)


class _Builder:
    """Scalar f32 arithmetic at one insertion point (the rewritten op's position)."""

    def __init__(self) -> None:
        from torch_mlir import ir
        from torch_mlir.dialects import arith, math

        self.ir, self.arith, self.math = ir, arith, math
        self.f32 = ir.F32Type.get()
        self.i32 = ir.IntegerType.get_signless(32)

    def const(self, value: float) -> Any:
        return self.arith.constant(self.f32, self.ir.FloatAttr.get(self.f32, value))

    def iconst(self, value: int) -> Any:
        return self.arith.constant(self.i32, self.ir.IntegerAttr.get(self.i32, value))

    def add(self, a: Any, b: Any) -> Any:
        return self.arith.addf(a, b)

    def mul(self, a: Any, b: Any) -> Any:
        return self.arith.mulf(a, b)

    def exp(self, x: Any) -> Any:
        """exp(x) for f32 in arithmetic: NaN stays NaN (IEEE min/max propagate it), overflow
        gives +inf and underflow 0, like libm; 2^n is applied as two factors so n = 128 and
        subnormal results need no special case."""
        a, m = self.arith, self.math
        x = a.minimumf(a.maximumf(x, self.const(_EXP_LO)), self.const(_EXP_HI))
        n = m.floor(self.add(self.mul(x, self.const(_LOG2E)), self.const(0.5)))
        r = a.subf(x, self.mul(n, self.const(_LN2_HI)))
        r = a.subf(r, self.mul(n, self.const(_LN2_LO)))
        poly = self.const(_EXP_POLY[0])
        for c in (*_EXP_POLY[1:], _EXP_HALF):
            poly = self.add(self.mul(poly, r), self.const(c))
        y = self.add(self.add(self.mul(poly, self.mul(r, r)), r), self.const(1.0))
        ni = a.fptosi(self.i32, n)
        half = a.shrsi(ni, self.iconst(1))
        rest = a.subi(ni, half)
        for part in (half, rest):
            bits = a.shli(a.addi(part, self.iconst(127)), self.iconst(23))
            y = self.mul(y, a.bitcast(self.f32, bits))
        return y

    def erf(self, x: Any) -> Any:
        """erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (clamped: erf is +-1 in f32 beyond)."""
        a = self.arith
        x = a.minimumf(a.maximumf(x, self.const(-_ERF_CLAMP)), self.const(_ERF_CLAMP))
        x2 = self.mul(x, x)
        num = self.const(_ERF_NUM[0])
        for c in _ERF_NUM[1:]:
            num = self.add(self.mul(num, x2), self.const(c))
        den = self.const(_ERF_DEN[0])
        for c in _ERF_DEN[1:]:
            den = self.add(self.mul(den, x2), self.const(c))
        return a.divf(self.mul(x, num), den)

    def tanh(self, x: Any) -> Any:
        """tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|); an odd Taylor polynomial
        below |x| = 1/16, where 1 - e would cancel."""
        a, m = self.arith, self.math
        ax = m.absf(x)
        e = self.exp(self.mul(ax, self.const(-2.0)))
        big = a.divf(a.subf(self.const(1.0), e), self.add(self.const(1.0), e))
        x2 = self.mul(x, x)
        poly = self.const(_TANH_TAYLOR[-1])
        for c in reversed(_TANH_TAYLOR[:-1]):
            poly = self.add(self.mul(poly, x2), self.const(c))
        small = self.add(self.mul(self.mul(poly, x2), ax), ax)
        pred = self.arith.CmpFPredicate.OLT
        magnitude = a.select(a.cmpf(pred, ax, self.const(_TANH_SMALL)), small, big)
        return m.copysign(magnitude, x)


_EXPANDED = {"math.exp": "exp", "math.tanh": "tanh", "math.erf": "erf"}


def expand_transcendentals(module: ir.Module) -> int:
    """Rewrite scalar f32 ``math.exp``/``math.tanh``/``math.erf`` in linalg bodies into
    arithmetic.

    Returns:
        The number of ops rewritten.
    """
    from torch_mlir import ir

    found: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name in _EXPANDED and str(op.results[0].type) == "f32":
            found.append(op)
        return ir.WalkResult.ADVANCE

    with module.context, ir.Location.unknown():
        module.operation.walk(collect)
        builder = _Builder() if found else None
        for op in found:
            assert builder is not None
            with ir.InsertionPoint(op):
                x = op.operands[0]
                new = getattr(builder, _EXPANDED[op.name])(x)
            op.results[0].replace_all_uses_with(new)
            op.erase()
    return len(found)


def fuse_rows(module: ir.Module) -> int:
    """Tile each op whose result the function returns by rows (every parallel loop but the
    innermost loop by 1) and fuse its producers into that row loop (greedy tile-and-fuse), so
    a softmax or norm reads its row once into cache and every intermediate stays a row.

    A producer used by several fused consumers is recomputed per consumer (softmax's exp once
    for the sum and once for the division), as Inductor's own CPU kernels do; one also used
    outside the loop keeps its standalone copy.

    Returns:
        The number of row loops created.
    """
    from torch_mlir import ir
    from torch_mlir.dialects.transform import interpreter

    roots: list[tuple[ir.Operation, list[int]]] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "func.return":
            for value in op.operands:
                owner = value.owner
                if isinstance(owner, ir.OpView):
                    owner = owner.operation
                if isinstance(owner, ir.Operation) and owner.name == "linalg.generic":
                    kinds = [str(t) for t in owner.attributes["iterator_types"]]
                    sizes = [
                        1 if "parallel" in kind and i < len(kinds) - 1 else 0
                        for i, kind in enumerate(kinds)
                    ]
                    # outer loops (tile size 1) may run to dynamic bounds; the innermost,
                    # vectorised whole or in static pieces, needs a static range
                    ranges = loop_ranges(owner)
                    if any(sizes) and ranges and ranges[-1] is not None:
                        roots.append((owner, sizes))
        return ir.WalkResult.ADVANCE

    with module.context, ir.Location.unknown():
        module.operation.walk(collect)
        if not roots:
            return 0
        i64 = ir.IntegerType.get_signless(64)
        lines = [
            "module attributes {transform.with_named_sequence} {",
            "transform.named_sequence @__transform_main("
            "%root: !transform.any_op {transform.readonly}) {",
        ]
        for index, (op, sizes) in enumerate(roots):
            op.attributes[TILE_ATTR] = ir.IntegerAttr.get(i64, index)
            loops = ", ".join(["!transform.any_op"] * sum(1 for s in sizes if s))
            lines += [
                f"%m{index} = transform.structured.match attributes "
                f"{{{TILE_ATTR} = {index} : i64}} in %root "
                ": (!transform.any_op) -> !transform.any_op",
                f"%f{index}, %l{index}:{loops.count('!')} = transform.structured.fuse %m{index} "
                f"tile_sizes {sizes} {{apply_cleanup}} "
                f": (!transform.any_op) -> (!transform.any_op, {loops})",
            ]
        lines += ["transform.yield", "}", "}"]
        script = ir.Module.parse("\n".join(lines))
        interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)

        def untag(op: ir.Operation) -> ir.WalkResult:
            if TILE_ATTR in op.attributes:
                del op.attributes[TILE_ATTR]
            return ir.WalkResult.ADVANCE

        module.operation.walk(untag)
    return len(roots)


def fold_empty_slices(module: ir.Module) -> None:
    """Give row-loop intermediates row-sized buffers: ``extract_slice(tensor.empty)`` becomes a
    row-sized ``tensor.empty``, which bufferises to one row buffer hoisted out of the loop
    (``buffer-loop-hoisting``) instead of a slice of a whole-tensor allocation."""
    from torch_mlir import ir
    from torch_mlir.dialects.transform import interpreter

    script = ir.Module.parse(
        "module attributes {transform.with_named_sequence} {\n"
        "transform.named_sequence @__transform_main("
        "%root: !transform.any_op {transform.readonly}) {\n"
        '%f = transform.structured.match ops{["func.func"]} in %root '
        ": (!transform.any_op) -> !transform.any_op\n"
        "transform.apply_patterns to %f {\n"
        "  transform.apply_patterns.tensor.fold_tensor_empty\n"
        "  transform.apply_patterns.canonicalization\n"
        "} : !transform.any_op\n"
        "transform.yield\n}\n}",
        module.context,
    )
    interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)


def tile_and_vectorize(module: ir.Module) -> int:
    """Tile every ``linalg.generic`` of ``module`` (linalg on tensors) to innermost rows and
    vectorise it; ops with a dynamic innermost range or unsuitable ranges stay as they are
    (scalar loops).

    Returns:
        The number of ops vectorised.
    """
    from torch_mlir import ir
    from torch_mlir.dialects.transform import interpreter

    ops: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "linalg.generic":
            ops.append(op)
        return ir.WalkResult.ADVANCE

    plans: list[tuple[int, list[int]]] = []
    with module.context, ir.Location.unknown():
        module.operation.walk(collect)
        i64 = ir.IntegerType.get_signless(64)
        for op in ops:
            kinds = [str(t) for t in op.attributes["iterator_types"]]
            sizes = tile_sizes(loop_ranges(op), bool(kinds) and "reduction" in kinds[-1])
            if sizes is None:
                continue
            op.attributes[TILE_ATTR] = ir.IntegerAttr.get(i64, len(plans))
            plans.append((len(plans), sizes))
        if plans:
            script = ir.Module.parse(transform_script(plans))
            interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)
    return len(plans)
