"""JIT-compiled regions: an LRU of ExecutionEngines keyed by the region's IR, and the call path
that hands torch tensors to them as memref descriptors (no copies for contiguous inputs)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import re
import threading
from typing import Any

import torch

from mfusion.mlir.importer import REGION_FUNC
from mfusion.mlir.pipeline import Pipeline, lower_to_llvm

# Element types the JIT path accepts; the capability table keeps other dtypes with Inductor.
SUPPORTED_DTYPES = frozenset({torch.float32, torch.float64, torch.int64, torch.int32, torch.bool})

_LOCK = threading.Lock()


def _descriptor_type(rank: int) -> type[ctypes.Structure]:
    """The C layout of a ranked memref: allocated, aligned, offset, sizes[rank], strides[rank]."""
    fields = [
        ("allocated", ctypes.c_void_p),
        ("aligned", ctypes.c_void_p),
        ("offset", ctypes.c_longlong),
    ]
    if rank:
        fields += [("shape", ctypes.c_longlong * rank), ("strides", ctypes.c_longlong * rank)]
    return type(f"MemRef{rank}D", (ctypes.Structure,), {"_fields_": fields})


_DESCRIPTORS = {rank: _descriptor_type(rank) for rank in range(9)}


def memref_of(tensor: torch.Tensor) -> ctypes.Structure:
    """A memref descriptor viewing ``tensor``'s storage (strides in elements, as MLIR expects)."""
    desc = _DESCRIPTORS[tensor.dim()]()
    desc.allocated = desc.aligned = tensor.data_ptr()
    desc.offset = 0
    if tensor.dim():
        desc.shape[:] = list(tensor.shape)
        desc.strides[:] = list(tensor.stride())
    return desc


def _engine(module: Any, opt_level: int) -> Any:
    """The module's ExecutionEngine. A translation failure is raised with MLIR's own messages
    instead of the engine's generic "Failure while creating the ExecutionEngine", and those
    messages are kept off stderr, where MLIR's default handler prints them: the caller tries
    another pipeline or leaves the region with Inductor, and reports why."""
    from torch_mlir.execution_engine import ExecutionEngine

    messages: list[str] = []

    def collect(diagnostic: Any) -> bool:
        messages.append(str(diagnostic.message))
        return True  # handled: not printed

    handler = module.context.attach_diagnostic_handler(collect)
    try:
        return ExecutionEngine(module, opt_level=opt_level)
    except RuntimeError as error:
        if not messages:
            raise
        raise RuntimeError("; ".join(messages)) from error
    finally:
        handler.detach()


class CompiledRegion:
    """One region JIT-compiled for the CPU; call it with inputs and preallocated outputs."""

    def __init__(
        self, torch_backend_asm: str, pipeline: Pipeline = "vector", opt_level: int = 3
    ) -> None:
        self.pipeline = pipeline
        self.ir = torch_backend_asm
        module = lower_to_llvm(torch_backend_asm, pipeline)
        self.engine = _engine(module, opt_level)
        self._entry = self.engine.lookup(REGION_FUNC)
        self._local = threading.local()
        self.shapes = signature_shapes(torch_backend_asm)
        """Shapes of the kernel's arguments then results (None: not read from the IR)."""
        self.dynamic = has_dynamic_dims(torch_backend_asm)
        """Compiled with dynamic (``?``) dims: one kernel for every size of those dims."""

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        # The region was compiled for identity layouts: make inputs contiguous (a no-op when
        # they already are) so the strides we pass agree with what the code assumes.
        tensors = [t.contiguous() for t in inputs] + outputs
        # The descriptors are built once per layout (and per thread: row blocks call one kernel
        # from several threads) and only the data pointers change per call; building ctypes
        # structures on every call cost tens of microseconds. A kernel with dynamic dims sees
        # many layouts: the most recent ones are kept.
        key = tuple((tuple(t.shape), t.stride()) for t in tensors)
        packs: dict[Any, Any] | None = getattr(self._local, "packs", None)
        if packs is None:
            packs = self._local.packs = {}
        pack = packs.get(key)
        if pack is None:
            if len(packs) >= _MAX_LAYOUTS:
                packs.clear()
            descriptors = [memref_of(self._as_compiled(i, t)) for i, t in enumerate(tensors)]
            pointers = [ctypes.pointer(d) for d in descriptors]
            packed = (ctypes.c_void_p * len(pointers))()
            for i, pointer in enumerate(pointers):
                packed[i] = ctypes.cast(ctypes.pointer(pointer), ctypes.c_void_p)
            pack = packs[key] = (descriptors, pointers, packed)
        descriptors, _, packed = pack
        for descriptor, tensor in zip(descriptors, tensors, strict=True):
            descriptor.allocated = descriptor.aligned = tensor.data_ptr()
        self._entry(packed)

    def _as_compiled(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` viewed in the shape the kernel was compiled for: a matmul region compiled
        in its 2-D form (:mod:`mfusion.mlir.flatten`) takes the graph's 3-D tensors as the same
        memory with merged leading dims (same data pointer, so the descriptor built here stays
        valid for every call with this layout)."""
        if self.shapes is None or index >= len(self.shapes):
            return tensor
        shape = self.shapes[index]
        if tuple(tensor.shape) == shape:
            return tensor
        if tensor.numel() != math.prod(shape) or not tensor.is_contiguous():
            raise ValueError(
                f"argument {index} has shape {tuple(tensor.shape)}, the kernel takes {shape}"
            )
        return tensor.view(shape)


_MAX_LAYOUTS = 64
"""Descriptor sets kept per kernel and thread (one per argument layout seen)."""

_SIGNATURE = re.compile(rf"func\.func @{REGION_FUNC}\((.*)$", re.MULTILINE)
_TENSOR_TYPE = re.compile(r"!torch\.vtensor<\[([0-9,]*)\],")


def signature_shapes(torch_backend_asm: str) -> list[tuple[int, ...]] | None:
    """Static shapes of the region function's tensor arguments then results, read from its
    torch backend IR signature; None where the signature is missing or has a dynamic dim."""
    found = _SIGNATURE.search(torch_backend_asm)
    if found is None or "?" in found.group(1):
        return None
    return [
        tuple(int(d) for d in dims.split(",")) if dims else ()
        for dims in _TENSOR_TYPE.findall(found.group(1))
    ]


def has_dynamic_dims(torch_backend_asm: str) -> bool:
    """Whether the region function's signature has a dynamic (``?``) dim."""
    found = _SIGNATURE.search(torch_backend_asm)
    return found is not None and "?" in found.group(1)


def region_key(torch_backend_asm: str) -> str:
    """Short stable hash of a region's IR (cache keys, log lines)."""
    return hashlib.sha256(torch_backend_asm.encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=256)
def _compile_cached(key: str, torch_backend_asm: str, pipeline: Pipeline) -> CompiledRegion:
    return CompiledRegion(torch_backend_asm, pipeline)


_BY_IR: dict[tuple[str, str], CompiledRegion] = {}


def compiled_region(torch_backend_asm: str, pipeline: Pipeline = "vector") -> CompiledRegion:
    """The JIT-compiled region for this IR and pipeline, compiled on first use (thread-safe).

    Called on every run of ``mfusion::mlir_region``: the fast path is one dict lookup keyed by
    the IR string itself (whose hash Python caches), not a SHA-256 of the IR per call.
    """
    found = _BY_IR.get((torch_backend_asm, pipeline))
    if found is not None:
        return found
    with _LOCK:
        region = _compile_cached(region_key(torch_backend_asm), torch_backend_asm, pipeline)
        if len(_BY_IR) < 1024:
            _BY_IR[(torch_backend_asm, pipeline)] = region
        return region


def run_blocks(
    kernel: CompiledRegion,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    split: list[bool],
    blocks: int,
) -> None:
    """Run ``kernel``, compiled for ``rows / blocks`` rows (or for any rows: a kernel with
    dynamic dims, cut into at most ``blocks`` blocks of this call's rows), on each block of rows
    of the outputs (and of the inputs flagged in ``split``; the others are passed whole), the
    blocks in parallel on a thread pool (see :mod:`mfusion.mlir.threads`)."""
    from mfusion.mlir.threads import block_bounds, pool

    rows = outputs[0].shape[0]
    if kernel.dynamic:
        bounds = block_bounds(rows, blocks)  # one kernel for any block: cut per call
    elif blocks < 1 or rows % blocks:
        raise ValueError(f"blocks={blocks} must divide the {rows} rows of the region")
    else:
        bounds = [(k * (rows // blocks), rows // blocks) for k in range(blocks)]
    tensors = [t.contiguous() for t in inputs]

    def one(index: int) -> None:
        lo, length = bounds[index]
        kernel(
            [t.narrow(0, lo, length) if s else t for t, s in zip(tensors, split, strict=True)],
            [o.narrow(0, lo, length) for o in outputs],
        )

    futures = [pool(len(bounds) - 1).submit(one, k) for k in range(1, len(bounds))]
    one(0)
    for future in futures:
        future.result()
