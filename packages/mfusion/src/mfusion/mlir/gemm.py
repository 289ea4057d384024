"""Matmul + epilogue regions: register-blocked, vectorised GEMM with the epilogue in the tile.

A region of one 2-D matmul and its element-wise epilogue lowers (after torch-mlir) to
``linalg.fill`` + ``linalg.matmul`` + one fused ``linalg.generic`` epilogue, with a
``linalg.transpose`` of the weight when the matmul reads it transposed (a linear). The
transform dialect then builds the usual CPU GEMM loop nest:

- the epilogue is tiled over column panels of :data:`PANEL_N` (or a divisor of N); the
  transpose, fill and matmul are fused into that loop, so the weight is transposed once per
  panel into a K x N_panel buffer (the packing step) that stays in cache while every row block
  reads it;
- inside a panel, row blocks of :data:`BLOCK_M` rows (or a divisor of M) with the matmul and
  fill fused again, the matmul then tiled along K by 1: each K step is one outer product of an
  M_block column of the input with an N_panel row of the packed weight, accumulated in
  registers (vector iter_args, FMA through ``contract`` fast-math);
- the epilogue is vectorised on the M_block x N_panel accumulator, so the result is written
  once.

Before tiling, the forms of a training step are brought to that shape: every element-wise
generic behind the matmul is merged into one generic with one result per returned value
(:func:`merge_epilogue`: a forward that also returns its pre-activation, a backward epilogue
with several gradient pieces, a bare ``mm``), and a transposed left operand (a weight gradient
``g^T x``) is read through the matmul's indexing map (:func:`fold_left_transpose`).

Rows come in :data:`BLOCK_M`-row blocks whatever M is: the loop over them is peeled, so the
last ``M % BLOCK_M`` rows run in a loop of their own with static sizes (no masks). Taking the
largest divisor of M instead gave 1-row blocks for a prime M (197 tokens, 13), at 2-2.3x the
time of peeled blocks on the AVX2 CPU. A symbolic M (tokens under ``dynamic=True``; K and N are
the weight's, static) is peeled the same way: the full blocks run to the dynamic bound
``M - M mod 4`` and the rest, 0-3 rows known per call, is tiled again into 1-row blocks, so
one kernel serves every M with static tiles. Panels and transpose steps are still divisors of N and
K: an N without a good divisor gets narrower panels, and is slower; the measured choice
(:mod:`mfusion.mlir.choice`) keeps such regions with Inductor. No K blocking for L2, no
threads: MKL/oneDNN's GEMM is usually faster, which is what the choice measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_mlir import ir

BLOCK_M = 4
"""Rows per register block. 4 x 16 f32 accumulators are 8 AVX2 registers, leaving room for the
panel row and the broadcast input. On the AVX2 CPU (256 x 768 -> 3072) 8 x 32 blocks (32
registers: spills) took 2x the time of 4 x 16 and 8 x 16 1.4x; AVX-512 (32 wider registers)
would want wider blocks, not measured."""

PANEL_N = 16
"""Columns per panel (and per register block); the packed panel is K x 16."""

TRANSPOSE_ROWS = 8
"""K rows of the packed panel written per vectorised transpose step."""


def largest_divisor(extent: int, limit: int) -> int:
    """The largest divisor of ``extent`` not above ``limit`` (1 at worst)."""
    return max(d for d in range(1, min(extent, limit) + 1) if extent % d == 0)


def _ops(module: ir.Module, name: str) -> list[ir.Operation]:
    from torch_mlir import ir

    found: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    return found


def has_matmul(module: ir.Module) -> bool:
    """True if the linalg-on-tensors module holds a ``linalg.matmul`` (a GEMM region)."""
    return bool(_ops(module, "linalg.matmul"))


DYNAMIC = None
"""A dynamic (symbolic) row count in :func:`gemm_script`'s ``m``."""


def _shape(value: ir.Value, dynamic_rows: bool = False) -> list[int]:
    """The static shape of ``value``; with ``dynamic_rows`` dim 0 may be dynamic (a negative
    size, MLIR's ``?``), every other dim must be static."""
    from torch_mlir import ir

    shape = list(ir.ShapedType(value.type).shape)
    if any(s < 0 for s in shape[1 if dynamic_rows else 0 :]):
        raise ValueError("matmul regions are compiled for a static K and N")
    return shape


def _fresh_destination(transpose: ir.Operation) -> None:
    """Give the weight transpose its own ``tensor.empty``: torch-mlir's CSE may share one with
    the output (when K == M), and the packed panel would then be bufferised into the output."""
    from torch_mlir import ir
    from torch_mlir.dialects import tensor

    init = transpose.operands[1]
    shaped = ir.RankedTensorType(init.type)
    with ir.InsertionPoint(transpose):
        fresh = tensor.EmptyOp(list(shaped.shape), shaped.element_type)
    transpose.operands[1] = fresh.result


def row_block(m: int | None) -> tuple[int, bool]:
    """``(rows per block, peel)``: :data:`BLOCK_M`-row blocks, the ragged last block of M
    peeled into a loop of its own (``peel``), or M itself when it is smaller than a block. A
    dynamic M (:data:`DYNAMIC`) is always peeled: its rest, 0 to 3 rows, is known per call."""
    if m is None:
        return BLOCK_M, True
    if m <= BLOCK_M:
        return m, False
    return BLOCK_M, m % BLOCK_M != 0


def gemm_script(m: int | None, n: int, k: int, transposed: bool) -> str:
    """The transform sequence: panels over N (pack fused), row blocks over M (a ragged last
    block peeled), K steps of 1, vectorise, keep the accumulator in registers, lower
    contractions to outer products.

    With a dynamic M (``m`` is :data:`DYNAMIC`) the full blocks run to ``M - M mod 4`` (a
    dynamic bound, static 4-row tiles) and the peeled rest, whose 0-3 rows are only known per
    call, is tiled again into 1-row blocks: every tile keeps a static shape, so both loops
    take the same vectorised lowering without masks."""
    block_m, peel = row_block(m)
    panel_n = largest_divisor(n, PANEL_N)
    rows = largest_divisor(k, TRANSPOSE_ROWS)
    op = "!transform.any_op"
    loop = '!transform.op<"scf.for">'
    pair = f"({op}, {op}) -> ({op}, {op})"

    def match(name: str, what: str, where: str = "%root") -> str:
        return f'%{name} = transform.structured.match ops{{["{what}"]}} in {where} : ({op}) -> {op}'

    lines = [
        "module attributes {transform.with_named_sequence} {",
        f"transform.named_sequence @__transform_main(%root: {op} {{transform.readonly}}) {{",
        match("ret", "func.return"),
        f"%epi = transform.get_producer_of_operand %ret[0] : ({op}) -> {op}",
        match("mm", "linalg.matmul"),
        match("fill", "linalg.fill"),
        f"%epi_n, %panel = transform.structured.tile_using_for %epi tile_sizes [0, {panel_n}] "
        f": ({op}) -> ({op}, {op})",
        f"%mm_n, %p1 = transform.structured.fuse_into_containing_op %mm into %panel : {pair}",
        f"%fill_n, %p2 = transform.structured.fuse_into_containing_op %fill into %p1 : {pair}",
    ]
    if transposed:
        lines += [
            match("tr", "linalg.transpose"),
            f"%tr_n, %p3 = transform.structured.fuse_into_containing_op %tr into %p2 : {pair}",
        ]
    lines += [
        f"%epi_b, %block = transform.structured.tile_using_for %epi_n tile_sizes [{block_m}, 0] "
        f": ({op}) -> ({op}, {op})",
        f"%mm_b, %b1 = transform.structured.fuse_into_containing_op %mm_n into %block : {pair}",
        match("func", "func.func"),
    ]
    if m is None:
        # a dynamic M reads its row counts through tensor.dim of the panel's fill; folded to
        # the input's dim, so the fill's only use in the row loop is the slice it is fused by
        lines += [
            "transform.apply_patterns to %func {",
            "  transform.apply_patterns.canonicalization",
            f"}} : {op}",
        ]
    lines += [
        f"%fill_b, %b2 = transform.structured.fuse_into_containing_op %fill_n into %b1 : {pair}",
    ]
    if peel:
        # full blocks in one loop, the last M % BLOCK_M rows in a second: both static-sized
        # after canonicalisation (a dynamic M's rest after its 1-row tiling, below), so both
        # vectorise without masks
        lines += [
            f"%rows = transform.cast %b2 : {op} to {loop}",
            f"%full, %rest = transform.loop.peel %rows : ({loop}) -> ({op}, {op})",
        ]
    if peel and m is None:
        # the rest's row count is dynamic (M mod 4): one row per block
        lines += [
            match("epi_r", "linalg.generic", "%rest"),
            match("mm_r", "linalg.matmul", "%rest"),
            match("fill_r", "linalg.fill", "%rest"),
            f"%epi_1, %one = transform.structured.tile_using_for %epi_r tile_sizes [1, 0] "
            f": ({op}) -> ({op}, {op})",
            f"%mm_1, %o1 = transform.structured.fuse_into_containing_op %mm_r into %one : {pair}",
            f"%fill_1, %o2 = transform.structured.fuse_into_containing_op %fill_r into %o1 "
            f": {pair}",
        ]
    if peel:
        lines += [
            "transform.apply_patterns to %func {",
            "  transform.apply_patterns.canonicalization",
            f"}} : {op}",
        ]
    # from here on every matmul, fill, epilogue and transpose of the function (one of each,
    # or one per row loop when the last block was peeled)
    lines += [
        match("mms", "linalg.matmul", "%func"),
        f"%mm_k, %kloop = transform.structured.tile_using_for %mms tile_sizes [0, 0, 1] "
        f": ({op}) -> ({op}, {op})",
        # the packed panel gets its own K x N_panel buffer, not a slice of a K x N tensor
        "transform.apply_patterns to %func {",
        "  transform.apply_patterns.tensor.fold_tensor_empty",
        f"}} : {op}",
    ]
    if transposed:
        lines += [
            match("trs", "linalg.transpose", "%func"),
            f"%tr_r, %trloop = transform.structured.tile_using_for %trs tile_sizes [{rows}, 0] "
            f": ({op}) -> ({op}, {op})",
            f"transform.structured.vectorize %tr_r : {op}",
        ]
    lines += [
        match("fills", "linalg.fill", "%func"),
        match("epis", "linalg.generic", "%func"),
        f"transform.structured.vectorize %mm_k : {op}",
        f"transform.structured.vectorize %fills : {op}",
        f"transform.structured.vectorize %epis : {op}",
        "transform.apply_patterns to %func {",
        "  transform.apply_patterns.vector.cast_away_vector_leading_one_dim",
        "  transform.apply_patterns.vector.transfer_permutation_patterns",
        "  transform.apply_patterns.canonicalization",
        f"}} : {op}",
        f"transform.apply_licm to %kloop : {op}",
        f"transform.loop.hoist_loop_invariant_subsets %kloop : {op}",
        "transform.apply_patterns to %func {",
        '  transform.apply_patterns.vector.lower_contraction lowering_strategy = "outerproduct"',
        "  transform.apply_patterns.vector.lower_outerproduct",
        "  transform.apply_patterns.canonicalization",
        f"}} : {op}",
        "transform.yield",
        "}",
        "}",
    ]
    return "\n".join(lines)


def _owner(value: ir.Value) -> ir.Operation | None:
    """The operation defining ``value`` (None for a block argument)."""
    from torch_mlir import ir

    owner = value.owner
    if isinstance(owner, ir.Block):
        return None
    return owner if isinstance(owner, ir.Operation) else owner.operation


def fold_left_transpose(matmul: ir.Operation) -> ir.Operation:
    """``matmul(transpose(g), x)`` as one matmul reading ``g`` through a transposed map.

    A weight gradient is ``g^T x`` (K = tokens). Tiled as it comes, the transpose would be
    fused into every panel and rebuilt per row block; read through the matmul's indexing map,
    each K step of a row block takes ``BLOCK_M`` consecutive elements of one row of ``g`` (the
    broadcast operand of the outer product) straight from memory. Returns the matmul in use.
    """
    from torch_mlir import ir
    from torch_mlir.dialects import linalg

    transpose = _owner(matmul.operands[0])
    if transpose is None or transpose.name != "linalg.transpose":
        return matmul
    if list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"])) != [1, 0]:
        return matmul
    if len(list(transpose.results[0].uses)) != 1:
        return matmul
    d0, d1 = ir.AffineDimExpr.get(0), ir.AffineDimExpr.get(1)
    d2 = ir.AffineDimExpr.get(2)
    maps = [ir.AffineMap.get(3, 0, exprs) for exprs in ([d2, d0], [d2, d1], [d0, d1])]
    with ir.InsertionPoint(matmul):
        folded = linalg.matmul(
            transpose.operands[0], matmul.operands[1], outs=[matmul.operands[2]], indexing_maps=maps
        )
    matmul.results[0].replace_all_uses_with(folded)
    matmul.erase()
    transpose.erase()
    owner = _owner(folded)
    assert owner is not None  # a matmul's result
    return owner


def _identity(attr: ir.Attribute) -> bool:
    from torch_mlir import ir

    affine = ir.AffineMapAttr(attr).value
    return affine.is_permutation and list(affine.results) == [
        ir.AffineDimExpr.get(i) for i in range(affine.n_dims)
    ]


def merge_epilogue(module: ir.Module, matmul: ir.Operation) -> ir.Operation:
    """Every element-wise ``linalg.generic`` behind the matmul, merged into one generic with one
    result per returned value (the matmul's own result included).

    A training forward returns the pre-activation (saved for the backward) as well as the
    activation; a backward epilogue returns several products of the gradient (a residual sum
    and the pieces of a LayerNorm backward). torch-mlir writes each as its own generic, and
    element-wise fusion keeps a producer that has other uses apart, so the GEMM tiling (one
    epilogue per panel) would have to recompute the matmul or fail. Merged, the accumulator
    tile feeds one epilogue that writes every output once. A bare matmul gets a copy epilogue
    (the accumulator written out by the same tile code).

    Raises:
        ValueError: A generic is not an element-wise op over the matmul's M x N domain (a
            reduction, a broadcast of an intermediate, a prologue feeding the matmul).
    """
    from torch_mlir import ir
    from torch_mlir.dialects import arith, linalg, tensor

    (ret,) = _ops(module, "func.return")
    generics = _ops(module, "linalg.generic")
    result_shape = _shape(matmul.results[0], dynamic_rows=True)
    element = ir.RankedTensorType(matmul.results[0].type).element_type

    def produced_by_group(value: ir.Value) -> tuple[ir.Operation, int] | None:
        owner = _owner(value)
        for g in generics:
            if owner is not None and owner == g:
                return g, ir.OpResult(value).result_number
        return None

    def is_matmul(value: ir.Value) -> bool:
        owner = _owner(value)
        return owner is not None and owner == matmul

    for g in generics:
        iterators = [str(t) for t in ir.ArrayAttr(g.attributes["iterator_types"])]
        if any("parallel" not in t for t in iterators) or len(iterators) != 2:
            raise ValueError("an epilogue op that is not element-wise over M x N")
        maps = list(ir.ArrayAttr(g.attributes["indexing_maps"]))
        n_in = len(g.operands) - len(g.results)
        for result, attr in zip(g.results, maps[n_in:], strict=True):
            if _shape(result, dynamic_rows=True) != result_shape or not _identity(attr):
                raise ValueError("an epilogue result that is not M x N")
        for operand, attr in zip(g.operands[:n_in], maps[:n_in], strict=True):
            if (is_matmul(operand) or produced_by_group(operand)) and not _identity(attr):
                raise ValueError("an intermediate read through a broadcast")
        body = g.regions[0].blocks[0]
        if any(len(list(arg.uses)) for arg in list(body.arguments)[n_in:]):
            raise ValueError("an epilogue reading its output")
        for user_op in _users(g):
            if user_op == matmul or user_op.name == "linalg.transpose":
                raise ValueError("an element-wise prologue feeding the matmul")
    for producer in (matmul, *generics):
        for user_op in _users(producer):
            if user_op != ret and not any(user_op == g for g in generics):
                raise ValueError("the matmul or its epilogue read by an op outside the epilogue")
    returned = list(ret.operands)
    if not all(is_matmul(v) or produced_by_group(v) for v in returned):
        raise ValueError("a returned value that is neither the matmul nor its epilogue")
    if len(generics) == 1 and len(returned) == 1 and not is_matmul(returned[0]):
        return generics[0]

    # inputs of the merged op: every operand from outside the group (with its map)
    inputs: list[ir.Value] = []
    input_maps: list[ir.Attribute] = []
    for g in generics:
        maps = list(ir.ArrayAttr(g.attributes["indexing_maps"]))
        n_in = len(g.operands) - len(g.results)
        for operand, attr in zip(g.operands[:n_in], maps[:n_in], strict=True):
            if produced_by_group(operand) is None:
                inputs.append(operand)
                input_maps.append(attr)
    if any(map(is_matmul, returned)) and not any(map(is_matmul, inputs)):
        inputs.append(matmul.results[0])  # returned as it is (also a bare matmul's copy epilogue)
        input_maps.append(ir.AffineMapAttr.get(ir.AffineMap.get_identity(2)))
    out_map = ir.AffineMapAttr.get(ir.AffineMap.get_identity(2))
    with ir.InsertionPoint(ret):
        sizes: list[int | ir.Value] = list(result_shape)
        if result_shape[0] < 0:  # a dynamic row count: the matmul's own
            zero = arith.ConstantOp(ir.IndexType.get(), 0).result
            sizes[0] = tensor.DimOp(matmul.results[0], zero).result
        outputs = [tensor.EmptyOp(sizes, element).result for _ in returned]
        merged = linalg.GenericOp(
            [v.type for v in outputs],
            inputs,
            outputs,
            ir.ArrayAttr.get([*input_maps, *[out_map] * len(outputs)]),
            ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * 2),
        )
    arg_types = [ir.RankedTensorType(v.type).element_type for v in [*inputs, *outputs]]
    block = merged.regions[0].blocks.append(*arg_types)
    args = list(block.arguments)
    scalar: dict[tuple[int, int], ir.Value] = {}  # (generic index, result) -> value in block
    position = 0
    with ir.InsertionPoint(block):
        for index, g in enumerate(generics):
            n_in = len(g.operands) - len(g.results)
            body = g.regions[0].blocks[0]
            mapping: list[tuple[ir.Value, ir.Value]] = []
            for operand, arg in zip(g.operands[:n_in], list(body.arguments)[:n_in], strict=True):
                source = produced_by_group(operand)
                if source is None:
                    mapping.append((arg, args[position]))
                    position += 1
                else:
                    producer, number = source
                    mapping.append((arg, scalar[(generics.index(producer), number)]))
            for op in body.operations:
                if op.name == "linalg.yield":
                    for number, value in enumerate(op.operands):
                        scalar[(index, number)] = _mapped(value, mapping)
                    break
                copy = op.clone()
                for i, operand in enumerate(copy.operands):
                    copy.operands[i] = _mapped(operand, mapping)
                mapping += list(zip(op.results, copy.results, strict=True))
        yielded = []
        for value in returned:
            source = produced_by_group(value)
            if source is None:  # the matmul's result, returned as it is
                yielded.append(args[next(i for i, v in enumerate(inputs) if is_matmul(v))])
            else:
                producer, number = source
                yielded.append(scalar[(generics.index(producer), number)])
        linalg.YieldOp(yielded)
    for i, _value in enumerate(returned):
        ret.operands[i] = merged.results[i]
    for g in reversed(generics):
        g.erase()
    return merged.operation


def _mapped(value: ir.Value, mapping: list[tuple[ir.Value, ir.Value]]) -> ir.Value:
    for old, new in mapping:
        if old == value:
            return new
    return value


def _users(op: ir.Operation) -> list[ir.Operation]:
    return [use.owner for result in op.results for use in result.uses]


def tile_matmul_epilogue(module: ir.Module) -> None:
    """Apply :func:`gemm_script` to a linalg-on-tensors GEMM region (named ops kept): the left
    operand's transpose folded into the matmul (:func:`fold_left_transpose`), every epilogue
    merged into one multi-result generic (:func:`merge_epilogue`).

    Raises:
        ValueError: The region is not one matmul returned through element-wise epilogues (the
            caller then falls back to the scalar pipeline).
    """
    from torch_mlir import ir
    from torch_mlir.dialects.transform import interpreter

    with module.context, ir.Location.unknown():
        matmuls = _ops(module, "linalg.matmul")
        returns = _ops(module, "func.return")
        if len(matmuls) != 1 or len(returns) != 1:
            raise ValueError("a GEMM region is one matmul in one function")
        if len(_ops(module, "linalg.fill")) != 1:
            raise ValueError("a GEMM region zero-fills one accumulator")
        matmul = fold_left_transpose(matmuls[0])
        merge_epilogue(module, matmul)
        m, n = _shape(matmul.results[0], dynamic_rows=True)
        k = _shape(matmul.operands[1])[0]
        transposes = _ops(module, "linalg.transpose")
        if len(transposes) > 1:
            raise ValueError("more than one transpose in a GEMM region")
        if transposes:
            _fresh_destination(transposes[0])
        script = ir.Module.parse(gemm_script(DYNAMIC if m < 0 else m, n, k, bool(transposes)))
        interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)
        contract = ir.Attribute.parse("#arith.fastmath<contract>")
        for name in ("arith.mulf", "arith.addf"):  # lets LLVM form FMAs (no reassociation)
            for op in _ops(module, name):
                op.attributes["fastmath"] = contract
