"""Saved-activation bytes of one micro-batch per block, by placement, measured on the meta device.

One block of each kind is run forward on meta tensors (no memory, real shapes) through the job's
own pipeline stage module for that block, under a saved-tensor hook that counts what autograd
keeps for backward. The activation policy is then applied as a checkpointed region applies it:
the policy function of :func:`hyperparallel.activation.resolve` decides each producing op's
outputs (or, for size-only policies, each saved tensor), region inputs stay on the device (on the
host with ``swap_inputs``), weights are not activations, and when anything is recomputed the
outputs of saved and swapped ops are kept for the replay.

Routing is the one data-dependent part of a block: each ``nonzero`` over a mask that is called
``c`` times with the same shape in the block returns ``1 / c`` of the mask's elements, i.e. every
expert gets the same share of the token slots (a one-hot routing mask sets each element in
exactly one of the ``c`` masks, so the totals are exact whatever the routing); scalar reads
(``bool(t)``, ``t.item()``) read 0 inside the block (no expert index is the "no expert" slot) and
True outside it (the stage's mask checks: one unpadded sequence per sample, as the job's training
windows are). Attention runs the fused (flash) kernel that accelerators and
CPUs run, which saves its output and log-sum-exp rather than the ``[S, S]`` probabilities of the
math fallback the meta device would otherwise take.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from hyperparallel.activation import CheckpointPolicy, PolicyContext, PolicyFn, resolve
from hyperparallel.activation.report import is_parameter_like
from hyperparallel.plan.inventory import BUILT_IN_MODEL, Inventory, MetaModel, make_stage
from hyperparallel.train.config import ActivationConfig

aten = torch.ops.aten


@dataclass(frozen=True)
class ActivationBytes:
    """Saved-activation bytes of one forward, by where they wait for backward (as
    :class:`hyperparallel.activation.ActivationReport`)."""

    device: int = 0
    host: int = 0
    recomputed: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.recomputed

    def __add__(self, other: ActivationBytes) -> ActivationBytes:
        return ActivationBytes(
            self.device + other.device, self.host + other.host, self.recomputed + other.recomputed
        )

    def __mul__(self, times: int) -> ActivationBytes:
        return ActivationBytes(self.device * times, self.host * times, self.recomputed * times)


def _storage(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (the storage object itself: on meta every data_ptr is 0)."""
    return int(StorageWeakRef(t.untyped_storage()).cdata)


@dataclass
class _Op:
    index: int
    func: Any
    args: tuple
    kwargs: dict
    outputs: tuple[torch.Tensor, ...]


class _BlockForward(TorchDispatchMode):
    """Runs a block's ops on meta, answers its data-dependent ops (module docstring) and notes
    the op that allocated each storage."""

    def __init__(self, census: Counter[tuple[int, ...]] | None) -> None:
        super().__init__()
        self.counting = census is None
        self.calls: Counter[tuple[int, ...]] = Counter() if census is None else census
        self.given: Counter[tuple[int, ...]] = Counter()
        self.producers: dict[int, _Op] = {}
        self.ops: list[_Op] = []
        self.keep: list[torch.Tensor] = []  # storages stay alive (and distinct) until counted
        self.inside = False  # within the measured block's forward
        self.inputs: dict[int, int] = {}  # the block's tensor inputs: storage -> bytes
        self.flops = 0  # matmul and attention FLOPs of the block's forward

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            if args[0].dtype == torch.bool:
                return not self.inside
            return 0
        if func is aten.nonzero.default:
            out = self._nonzero(args[0])
        elif func is aten._grouped_mm.default:
            out = _grouped_mm(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if not self.inside:
            return out
        self.flops += _flops(func, args, kwargs, out)
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        fresh = tuple(
            t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel() and not aliases
        )
        if fresh:
            op = _Op(len(self.ops), func, args, kwargs, fresh)
            self.ops.append(op)
            for t in fresh:
                self.producers[_storage(t)] = op  # the latest fresh op, as the region's
                self.keep.append(t)
        return out

    def _nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        key = tuple(mask.shape)
        if self.counting:
            self.calls[key] += 1
            rows = mask.numel()
        else:
            share, extra = divmod(mask.numel(), self.calls[key])
            rows = share + (self.given[key] < extra)
            self.given[key] += 1
        return torch.empty((rows, mask.dim()), dtype=torch.long, device=mask.device)


class _FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` through a fused kernel that has a meta implementation,
    as on a device with fused attention: flash (what CPUs run too), or the memory-efficient
    kernel where the value head size differs from the query's (multi-head latent attention)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        options = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), rest, strict=False))
        options.update(kwargs)
        # enable_gqa dropped: the fused kernels take grouped key/value heads as they are
        mask, causal = options.get("attn_mask"), bool(options.get("is_causal", False))
        dropout, scale = options.get("dropout_p", 0.0), options.get("scale")
        if value.shape[-1] != query.shape[-1]:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, mask, True, dropout, causal, scale=scale
            )[0]
        else:
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout, causal, attn_mask=mask, scale=scale
            )[0]
        return out


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of the compute-bound ops: torch's flop-counter formulas for matmuls, flash
    attention at half the square for a causal mask (the fused kernels skip masked tiles), and
    ``2 S K N`` for a grouped matmul ``[S, K] x [G, K, N]``."""
    causal_at = {
        aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
        aten._scaled_dot_product_efficient_attention.default: 6,
    }
    if func in causal_at:
        query, key, value = args[:3]
        full = _attention_flops(query.shape, key.shape, value.shape)
        at = causal_at[func]
        causal = args[at] if len(args) > at else kwargs.get("is_causal", False)
        return int(full // 2 if causal else full)
    if func is aten._grouped_mm.default:
        a, b = args[:2]
        if b.dim() == 3:  # each row meets its group's [K, N]
            return 2 * out.numel() * a.shape[-1]
        return 2 * a.shape[0] * a.shape[1] * b.shape[-1]  # [M, S] x [S, N], groups along S
    formula = flop_registry.get(func._overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def _attention_flops(query: torch.Size, key: torch.Size, value: torch.Size) -> int:
    """FLOPs of ``softmax(Q K^T) V`` without a mask: the two batched matmuls, per query head.
    Grouped-query attention shares each key/value head among several query heads, so the count
    follows the query's heads (torch 2.9's ``sdpa_flop_count`` asserts equal head counts)."""
    batch, heads, queries, head_dim = query
    keys, value_dim = key[-2], value[-1]
    return 2 * batch * heads * queries * keys * (head_dim + value_dim)


def _grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, *_: Any, **__: Any
) -> torch.Tensor:
    """The output of ``aten._grouped_mm`` (whose meta kernel takes bf16 only; CPUs and GPUs run
    it in fp32 too): ``[S, K] x [G, K, N] -> [S, N]``, ``[G, M, K] x [G, K, N] -> [G, M, N]``,
    ``[M, S] x [S, N] -> [G, M, N]`` (G groups of ``offs``)."""
    if a.dim() == 2 and b.dim() == 3:
        shape: tuple[int, ...] = (a.shape[0], b.shape[-1])
    elif a.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    else:
        assert offs is not None
        shape = (offs.shape[0], a.shape[0], b.shape[-1])
    return torch.empty(shape, dtype=a.dtype, device=a.device)


@dataclass(frozen=True)
class _Saved:
    storage: int
    nbytes: int
    producer: _Op | None
    is_input: bool


@contextmanager
def _saved(into: list[_Saved], mode: _BlockForward) -> Iterator[None]:
    """Record each tensor autograd saves inside the block (after it started, so its inputs are
    known)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        if mode.inside and not is_parameter_like(t):
            key = _storage(t)
            into.append(
                _Saved(
                    key, t.untyped_storage().nbytes(), mode.producers.get(key), key in mode.inputs
                )
            )
            mode.keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def run_block(
    stage: nn.Module, block: nn.Module, x: torch.Tensor
) -> tuple[list[_Saved], _BlockForward]:
    """Run ``stage(x)`` forward on meta tensors and record what ``block`` (one of its blocks)
    saves for backward and which op made each storage; the block's own inputs are marked."""
    mode = _BlockForward(None)

    def enter(_: nn.Module, args: tuple, kwargs: dict) -> None:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not is_parameter_like(t):
                mode.inputs[_storage(t)] = t.untyped_storage().nbytes()
        mode.inside = True

    def leave(*_: Any) -> None:
        mode.inside = False

    handles = [
        block.register_forward_pre_hook(enter, with_kwargs=True),
        block.register_forward_hook(leave),
    ]
    saved: list[_Saved] = []
    try:
        with _FusedAttention(), mode, torch.enable_grad():  # the census of routing masks
            stage(x)
        mode = _BlockForward(mode.calls)
        with _FusedAttention(), mode, _saved(saved, mode), torch.enable_grad():
            stage(x)
    finally:
        for handle in handles:
            handle.remove()
    return saved, mode


def run_model(forward: Callable[[], object]) -> ActivationBytes:
    """What ``forward()`` (meta tensors, outside any checkpointed region) saves for backward:
    every storage once, on the device."""
    mode = _BlockForward(Counter())
    placed: dict[tuple, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not is_parameter_like(t):
            placed.setdefault(("kept", _storage(t)), (t.untyped_storage().nbytes(), "device"))
            mode.keep.append(t)
        return t

    with (
        _FusedAttention(),
        mode,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.enable_grad(),
    ):
        forward()
    return _sum(placed)


def apply_policy(
    saved: list[_Saved],
    mode: _BlockForward,
    policy: str,
    *,
    swap_inputs: bool = False,
    swap_threshold_bytes: int = 1 << 16,
    region: str = "block",
) -> ActivationBytes:
    """Place each saved tensor as a region with ``policy`` would (``"none"``: no region, all on
    the device). Entries are keyed as the activation tracker keys them: kept tensors by storage,
    swapped and recomputed ones by (producing op, storage); the first placement of a key wins."""
    placed: dict[tuple, tuple[int, str]] = {}
    if policy == "none":
        for s in saved:
            placed.setdefault(("kept", s.storage), (s.nbytes, "device"))
        return _sum(placed)
    policy_fn = resolve(policy, swap_threshold_bytes)
    size_rule = getattr(policy_fn, "size_rule", None)
    decided = {} if size_rule is not None else _decide(mode, policy_fn, region)
    recomputes = False
    for s in saved:
        if s.is_input:
            continue  # region inputs: counted when the forward ends, below
        if size_rule is not None:
            choice, producer = size_rule(s.nbytes), -1  # decided per storage as it is saved
        elif s.producer is not None:
            choice, producer = decided[s.producer.index], s.producer.index
        else:
            choice, producer = CheckpointPolicy.MUST_SAVE, -1  # made outside the region: kept
        where = _placement(choice)
        recomputes |= where == "recomputed"
        key = ("kept", s.storage) if where == "device" else (where, producer, s.storage)
        placed.setdefault(key, (s.nbytes, where))
    if recomputes and size_rule is None:
        # Saved ops' outputs are kept for the replay; a swapped op's host copies are the ones
        # counted above (an op none of whose outputs was saved is replayed instead).
        for op in mode.ops:
            if decided[op.index].is_save:
                for t in op.outputs:
                    placed.setdefault(
                        ("kept", _storage(t)), (t.untyped_storage().nbytes(), "device")
                    )
    # The region holds its inputs for a replay or for swapped input slots; otherwise it lets
    # them go and only those autograd saved wait for backward.
    saved_inputs = {s.storage: s.nbytes for s in saved if s.is_input}
    held = mode.inputs if recomputes or (swap_inputs and saved_inputs) else saved_inputs
    for storage, nbytes in held.items():
        placed.setdefault(("kept", storage), (nbytes, "host" if swap_inputs else "device"))
    return _sum(placed)


def _decide(mode: _BlockForward, policy_fn: PolicyFn, region: str) -> dict[int, CheckpointPolicy]:
    decided = {}
    for op in mode.ops:
        ctx = PolicyContext(region, op.index, op.outputs)
        choice = policy_fn(ctx, op.func, *op.args, **op.kwargs)
        decided[op.index] = CheckpointPolicy(choice or CheckpointPolicy.PREFER_RECOMPUTE)
    return decided


def _placement(choice: CheckpointPolicy) -> str:
    if choice.is_save:
        return "device"
    return "host" if choice.is_swap else "recomputed"


def _sum(placed: dict[tuple, tuple[int, str]]) -> ActivationBytes:
    totals = Counter[str]()
    for nbytes, where in placed.values():
        totals[where] += nbytes
    return ActivationBytes(totals["device"], totals["host"], totals["recomputed"])


@dataclass(frozen=True)
class BlockMeasure:
    """One block's forward on meta tensors for one micro-batch: what it saved, its op record
    (with the block's forward FLOPs), and its policy."""

    saved: list[_Saved]
    forward: _BlockForward
    policy: str

    @property
    def flops(self) -> int:
        return self.forward.flops


def measure_blocks(meta: MetaModel, inv: Inventory, micro_batch: int) -> tuple[BlockMeasure, ...]:
    """Run each kind of block (same parameter shapes and layer type) once on a micro-batch of
    ``micro_batch`` samples; one :class:`BlockMeasure` per block, in model order."""
    dtype = next(meta.module.parameters()).dtype
    config = getattr(getattr(meta.spec, "model", None), "config", None)
    layer_types = getattr(config, "layer_types", None) or [None] * inv.n_layers
    measured: dict[tuple, tuple[list[_Saved], _BlockForward]] = {}
    results = []
    for i, policy in enumerate(inv.block_policies):
        stage = make_stage(meta, range(i, i + 1), False, False)
        block = stage.get_submodule(f"layers.{i}")
        kind = (tuple((n, tuple(p.shape)) for n, p in block.named_parameters()), layer_types[i])
        if kind not in measured:
            with torch.device("meta"):
                x = torch.empty(micro_batch, inv.seq_len, inv.hidden, dtype=dtype).requires_grad_()
            measured[kind] = run_block(stage, block, x.clone())  # a block's input is no leaf
        results.append(BlockMeasure(*measured[kind], policy))
    return tuple(results)


def block_activations(
    meta: MetaModel,
    inv: Inventory,
    act: ActivationConfig,
    micro_batch: int,
    blocks: tuple[BlockMeasure, ...] | None = None,
) -> tuple[ActivationBytes, ...]:
    """Saved-activation bytes of each block for one micro-batch of ``micro_batch`` samples
    under its policy (``inv.block_policies``), from ``blocks`` (:func:`measure_blocks`, run
    here when not given)."""
    blocks = blocks or measure_blocks(meta, inv, micro_batch)
    dispatch = dispatch_activations(inv, micro_batch)
    return tuple(
        apply_policy(
            b.saved,
            b.forward,
            b.policy,
            swap_inputs=act.swap_inputs,
            swap_threshold_bytes=act.swap_threshold_bytes,
        )
        + dispatch.get(i, ActivationBytes())
        for i, b in enumerate(blocks)
    )


def dispatch_activations(inv: Inventory, micro_batch: int) -> dict[int, ActivationBytes]:
    """What expert parallelism's dispatch saves per MoE block beyond the local expert path the
    meta model runs, by block index (empty without ``ep``).

    Read from :meth:`hyperparallel.parallel.expert.ExpertParallelDispatch.dispatch` (one chunk):
    the local path and the dispatch both keep each routed row's expert input and intermediates,
    and the weighted expert output for the combine; the dispatch keeps in addition

    - the expert outputs of the received rows in the senders' order (``back``, ``[R, hidden]``),
      which the return exchange holds for backward,
    - under ``dp_shard > 1``, this rank's expert stacks as
      :meth:`~ExpertParallelDispatch.local_experts` gathers them over ``dp_shard`` (``E / ep``
      experts of every stack): a fresh copy per forward that autograd saves for the expert GEMMs
      until the block's backward, so one per micro-batch in flight (with ``dp_shard`` 1 the
      "gathered" stacks are views of the parameters: no memory, though the activation tracker
      counts them once),
    - two more ``int64`` indices over the routed pairs (the send gather and the combine each
      index by ``pairs // top_k``; the local path indexes its per-expert token ids once),
    - for a transformers model, one more ``[R, hidden]``: its experts' own forward runs on the
      received rows with unit weights and keeps its weighted output, and the dispatch's combine
      keeps its own (the built-in MoE's expert function leaves the weighting to the combine).

    Routing is assumed balanced, as everywhere in the planner: every rank receives as many rows
    as it sends, ``R = tokens x top_k``; a real rank receives more or fewer by how unevenly its
    router spreads the tokens. The bytes are recomputed with the block under a checkpoint
    policy (the dispatch runs inside the region) and kept on the device otherwise.
    """
    if inv.dims.ep == 1:
        return {}
    stack_bytes = dict.fromkeys(inv.moe_layers, 0)
    for p in inv.params:
        if p.expert_stack:
            stack_bytes[_block_of(p.name)] += p.nbytes
    itemsize = next(p.itemsize for p in inv.params if p.expert_stack)
    rows = micro_batch * inv.seq_len * inv.top_k
    outputs = 1 if inv.model == BUILT_IN_MODEL else 2
    exchanged = outputs * rows * inv.hidden * itemsize
    exchanged += 2 * rows * torch.empty((), dtype=torch.long).element_size()
    result = {}
    for block, stacks in stack_bytes.items():
        nbytes = exchanged + (stacks // inv.dims.ep if inv.dims.dp_shard > 1 else 0)
        if inv.block_policies[block] == "none":
            result[block] = ActivationBytes(device=nbytes)
        else:
            result[block] = ActivationBytes(recomputed=nbytes)
    return result


def _block_of(name: str) -> int:
    """The decoder block parameter ``name`` lives in (``...layers.<block>....``)."""
    parts = name.split(".")
    return next(int(b) for a, b in pairwise(parts) if a == "layers")
