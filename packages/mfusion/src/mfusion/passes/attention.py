"""Attention written out as ``bmm -> (scale) -> (+ mask) -> softmax -> bmm`` into one CPU
flash-attention call (``aten._scaled_dot_product_flash_attention_for_cpu``).

Where it comes from: transformers' ``eager`` attention (``attn_implementation="eager"``, what a
model without SDPA support or ``output_attentions=True`` runs) in Llama/Qwen/Mistral-style
decoders: ``matmul(q, k^T) * scaling + causal_mask``, ``softmax(dim=-1, dtype=float32)`` cast
back, ``matmul(., v)``, with the grouped K/V repeated by ``expand + reshape``. Inductor's own
SDPA patterns (``fuse_attention``) miss that form (the additive mask after the scale, the
repeated K/V, the fp32 softmax round trip), so its post-grad graph keeps two ``bmm`` and a
materialised ``[B, H, L, S]`` score tensor that is written and read three times.

Machine- and shape-dependent (measured, not universal): the flash kernel never materialises the
scores, which pays when they are large, but at short key lengths Inductor's fused softmax between
two BLAS calls is as fast or faster, and in bf16 the CPU flash kernel was measured slower at every
length tried on one AVX-512 CPU. So each attention shape is timed on the machine that compiles
(the flash call against Inductor's compiled bmm + softmax + bmm, on random inputs of the graph's
shapes, mask form and dtype; ``mfusion.passes._measured``, cached per shape and machine profile)
and rewritten only where flash is clearly faster. :data:`MIN_KEYS`, one machine's measurement,
is the fallback where timing is switched off. CPU only: on GPUs Inductor's own patterns and
kernels are left to decide.

Two forms the kernel runs cheaper, used where they are provably the same computation:

- **GQA.** transformers repeats grouped K/V heads (``repeat_kv``: unsqueeze, expand, copy,
  reshape) before the matmuls. The CPU flash kernel takes K/V with fewer heads than Q (each
  query head reads key head ``h // (H / H_kv)``, the order ``repeat_kv`` produces), so the
  un-repeated K/V go to the kernel and the copies go away. Used only where this torch's kernel
  is probed once to accept the grouped form and return the same result as the repeated one.
- **Causal.** A mask that depends on no graph input (built from ``iota`` comparisons, as
  transformers builds it, or a frozen constant) is evaluated at compile time; if it is exactly
  the causal mask (0 on and below the diagonal, at most -1e30 above it, any batch/head
  broadcast, L = S), the kernel is called with ``is_causal=True`` and no mask: it skips the
  blocks above the diagonal, and the result is the same (a masked score's ``exp`` is exactly
  0 either way; no row is fully masked). Any other mask is passed as a mask.

Inference only in effect: in a training graph the softmax output is saved for the backward, so
the probabilities have another user and the match is refused (a post-grad pass cannot change the
already-partitioned backward graph).
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._attention_form import CACHE_KIND, LABELS, AttentionForm
from mfusion.passes._graph import (
    CONVERT,
    as_node,
    aten,
    cast_target,
    constant_value,
    dtype_of,
    emit,
    int_list,
    is_float_scalar,
    is_op,
    normalized_dims,
    replace,
    tensor_val,
)
from mfusion.passes._measured import decide
from mfusion.passes.base import MFusionPass, Refusal, Rewrite

VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)

MIN_KEYS: dict[torch.dtype, int] = {torch.float32: 512}
"""The fallback where nothing may be timed (``NPU_CORE_DECISIONS=cached|fallback``): the smallest
key length (``S`` of the ``[B, H, L, S]`` scores) from which the flash call was measured faster
than Inductor's bmm + fused softmax + bmm on one machine (fp32, ``[2, 4, L, 64]`` with a causal
additive mask, one thread, 31 interleaved rounds on an AVX-512 CPU: S = L = 128: 0.98x, p25-p75
0.82-1.09, i.e. no gain; S = L = 512: 1.19x, p25-p75 1.14-1.25). bf16 is absent: the CPU flash
kernel measured 0.64x at 128 and 0.64x at 512 (p25-p75 0.61-0.70). Everywhere else the decision
is timed (:class:`~mfusion.passes._attention_form.AttentionForm`)."""


def _static_shape(node: object) -> tuple[int, ...] | None:
    value = tensor_val(node)
    if value is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(int(d) for d in value.shape)


BLOCKED = -1e30
"""A mask entry at or below this blocks its key exactly: ``exp(score + m - max)`` is 0."""


@functools.cache
def flash_takes_gqa() -> bool:
    """True if this torch's CPU flash kernel accepts K/V with fewer heads than Q and gives the
    result of the repeated K/V (probed once per process on a tiny causal case)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=gen)
    k, v = torch.randn(1, 2, 8, 16, generator=gen), torch.randn(1, 2, 8, 16, generator=gen)
    try:
        with unset_fake_temporarily():
            grouped = flash(q, k, v, 0.0, True)[0]
            repeated = flash(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 0.0, True)[0]
    except (RuntimeError, ValueError, TypeError):
        return False
    return grouped.shape == repeated.shape and bool(torch.allclose(grouped, repeated))


def _noop_slices(node: object) -> object:
    """Skip ``slice`` ops that keep the whole dimension (``x[:, :, None]`` writes them)."""
    while is_op(node, aten.slice.Tensor) and _static_shape(node) == _static_shape(node.args[0]):
        node = node.args[0]
    return node


def ungrouped(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(kv, n_rep)`` when ``node`` is transformers' ``repeat_kv(kv, n_rep)`` of a 4-D ``kv``:
    ``reshape(expand(kv[:, :, None], [B, Hkv, n_rep, S, D]), [B, Hkv * n_rep, S, D])`` (the
    copy a reshape of an expand needs may sit between); None otherwise."""
    if not is_op(node, *VIEWS):
        return None
    source = node.args[0]
    if is_op(source, aten.clone.default):
        source = source.args[0]
    if not is_op(source, aten.expand.default):
        return None
    inner = _noop_slices(source.args[0])
    if not is_op(inner, aten.unsqueeze.default) or not isinstance(inner.args[1], int):
        return None
    kv = _noop_slices(inner.args[0])
    shape, expanded, kv_shape = _static_shape(node), _static_shape(source), _static_shape(kv)
    if shape is None or expanded is None or kv_shape is None or not isinstance(kv, fx.Node):
        return None
    if len(kv_shape) != 4 or len(expanded) != 5 or inner.args[1] % 5 != 2:
        return None
    b, heads, keys, dim = kv_shape
    n_rep = expanded[2]
    if expanded != (b, heads, n_rep, keys, dim) or shape != (b, heads * n_rep, keys, dim):
        return None
    return kv, n_rep


def is_causal_mask(mask: fx.Node, length: int, keys: int) -> bool:
    """True if ``mask`` is provably the causal additive mask of ``[.., length, keys]`` scores:
    it depends on no graph input (:func:`constant_value`), ``length == keys``, every entry on
    or below the diagonal is 0 and every entry above it is at most :data:`BLOCKED`."""
    if length != keys:
        return False  # the kernel's is_causal is top-left aligned; transformers' bottom-right
    value = constant_value(mask)
    if value is None or value.dim() != 4 or tuple(value.shape[-2:]) != (length, keys):
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        allowed = torch.ones(length, keys, dtype=torch.bool).tril()
        scores = value.float()
        open_ok = bool((scores[..., allowed] == 0).all())
        blocked_ok = bool((scores[..., ~allowed] <= BLOCKED).all())
    return open_ok and blocked_ok


def _strip(node: object) -> object:
    """Skip value-preserving copies: ``clone`` and ``expand`` to the shape it already has."""
    while isinstance(node, fx.Node):
        if is_op(node, aten.clone.default) or (
            is_op(node, aten.expand.default) and _static_shape(node) == _static_shape(node.args[0])
        ):
            node = node.args[0]
        else:
            break
    return node


def _heads(node: object) -> fx.Node | None:
    """The ``[B, H, M, N]`` tensor a 3-D ``bmm`` operand ``[B*H, M, N]`` flattens, or None."""
    node = _strip(node)
    if not is_op(node, *VIEWS):
        return None
    flat = _static_shape(node)
    source = _strip(node.args[0])
    shape = _static_shape(source)
    if flat is None or shape is None or len(flat) != 3 or len(shape) != 4:
        return None
    if flat != (shape[0] * shape[1], shape[2], shape[3]):
        return None
    return source if isinstance(source, fx.Node) else None


def _untransposed(node: fx.Node) -> fx.Node | None:
    """``k`` for ``permute(k, [0, 1, 3, 2])`` or ``transpose(k, -2, -1)`` of a 4-D ``k``."""
    if is_op(node, aten.permute.default):
        order = int_list(node.args[1])
        if order is not None and [d % 4 for d in order] == [0, 1, 3, 2]:
            return as_node(node.args[0])
    if is_op(node, aten.transpose.int):
        dims = int_list(list(node.args[1:3]))
        if dims is not None and {d % 4 for d in dims} == {2, 3}:
            return as_node(node.args[0])
    return None


def _last_dim(node: fx.Node, keepdim_index: int) -> bool:
    dims = normalized_dims(node.args[1], 4)
    keep = node.args[keepdim_index] if len(node.args) > keepdim_index else False
    return dims == (3,) and keep is True


class AttentionPass(MFusionPass):
    """Match ``bmm(softmax(scale * bmm(q, k^T) + mask), v)`` over 4-D heads; emit flash."""

    name = "attention"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.bmm.default):
            return None
        probs, v = _heads(node.args[0]), _heads(node.args[1])
        if probs is None or v is None:
            return None
        # Optional low-precision round trip: softmax(x.float()).to(bf16).
        low = cast_target(probs)
        softmax = probs.args[0] if low is not None else probs
        if not is_op(softmax, aten.div.Tensor):
            return None
        exp, total = softmax.args[0], softmax.args[1]
        if not (is_op(exp, aten.exp.default) and is_op(total, aten.sum.dim_IntList)):
            return None
        if total.args[0] is not exp or not _last_dim(total, 2):
            return None
        shifted = exp.args[0]
        if not is_op(shifted, aten.sub.Tensor) or not is_op(shifted.args[1], aten.amax.default):
            return None
        peak = shifted.args[1]
        softmax_in = as_node(shifted.args[0])
        if softmax_in is None or peak.args[0] is not softmax_in or not _last_dim(peak, 2):
            return None
        scores: object = softmax_in  # read twice (amax, sub): checked apart from the one-use chain
        chain = [shifted]
        if low is not None:
            if not is_op(scores, CONVERT) or cast_target(scores) != torch.float32:
                return None
            chain.append(scores)
            scores = scores.args[0]
        mask = None
        if is_op(scores, aten.add.Tensor):
            for candidate, other in (
                (scores.args[0], scores.args[1]),
                (scores.args[1], scores.args[0]),
            ):
                if _scaled_scores(candidate) is not None:
                    chain.append(scores)
                    scores, mask = candidate, other
                    break
            else:
                return None
        found = _scaled_scores(scores)
        if found is None:
            return None
        first, scale, scale_nodes = found
        chain += scale_nodes
        q = _heads(first.args[0])
        k_t = _heads(first.args[1])
        k = _untransposed(k_t) if k_t is not None else None
        if q is None or k is None:
            return None

        # The pattern is attention; now check it is safe and pays.
        if any(len(n.users) != 1 for n in chain if n is not softmax_in):
            raise Refusal("an intermediate of the attention has another user")
        if len(softmax_in.users) != 2 or len(exp.users) != 2 or len(peak.users) != 1:
            raise Refusal("the softmax terms are used elsewhere")
        if len(softmax.users) != 1:
            raise Refusal("the attention probabilities or softmax terms are used elsewhere")
        if low is not None and len(probs.users) != 1:
            raise Refusal("the attention probabilities are used elsewhere")
        shapes = [_static_shape(t) for t in (q, k, v)]
        if any(s is None for s in shapes):
            raise Refusal("symbolic or unknown shapes")
        (b, h, length, e), (bk, hk, keys, ek), (bv, hv, keys_v, ev) = shapes  # type: ignore[misc]
        if (b, h) != (bk, hk) or (b, h) != (bv, hv) or keys != keys_v or e != ek:
            raise Refusal(f"q/k/v shapes {shapes} do not form one attention")
        dtype = dtype_of(q)
        if not (dtype == dtype_of(k) == dtype_of(v)) or dtype not in (
            torch.float32,
            torch.bfloat16,
        ):
            raise Refusal(
                f"q/k/v dtypes {dtype}, {dtype_of(k)}, {dtype_of(v)}: need one of fp32, bf16"
            )
        if low is not None and low != dtype:
            raise Refusal(f"softmax cast back to {low}, queries are {dtype}")
        device = tensor_val(q).device  # type: ignore[union-attr]
        if device.type != "cpu":
            raise Refusal(f"device {device}: the flash rewrite is measured on CPU only")
        if mask is not None:
            mask_shape = _static_shape(mask)
            if mask_shape is None or len(mask_shape) != 4:
                raise Refusal(f"mask shape {mask_shape}: need a 4-D mask")
            if any(
                m not in (1, full) for m, full in zip(mask_shape, (b, h, length, keys), strict=True)
            ):
                raise Refusal(
                    f"mask shape {mask_shape} does not broadcast to {(b, h, length, keys)}"
                )
            if dtype_of(mask) != dtype:
                raise Refusal(f"mask dtype {dtype_of(mask)} differs from the queries' {dtype}")
        causal = isinstance(mask, fx.Node) and is_causal_mask(mask, length, keys)
        k_in, v_in, n_rep = k, v, 1
        grouped_k, grouped_v = ungrouped(k), ungrouped(v)
        if (
            grouped_k is not None
            and grouped_v is not None
            and grouped_k[1] == grouped_v[1] > 1
            and flash_takes_gqa()
        ):
            (k_in, n_rep), (v_in, _) = grouped_k, grouped_v
        form = AttentionForm(
            dtype, (b, h, length, e), keys, ev, _static_shape(mask), causal, n_rep, low is not None
        )
        choice = decide(
            CACHE_KIND,
            form.fields(),
            config.resolved_machine(),
            LABELS,
            form.calls,
            fallback_chosen=keys >= MIN_KEYS.get(dtype, keys + 1),
        )
        if not choice.chosen:
            raise Refusal(f"{form.describe()}: flash not faster here, {choice.describe()}")

        def rewrite() -> str:
            graph = node.graph
            kwargs: dict[str, object] = {"scale": scale}
            if mask is not None and not causal:
                kwargs["attn_mask"] = mask
            flash = emit(
                graph,
                aten._scaled_dot_product_flash_attention_for_cpu.default,
                q,
                k_in,
                v_in,
                0.0,
                causal,
                **kwargs,
            )
            out = emit(graph, operator.getitem, flash, 0)
            # Users that only view the result back to [B, H, L, Ev] take the 4-D output directly
            # (the flash output's own layout; a round trip through 3-D would force a copy).
            for user in list(node.users):
                if is_op(user, *VIEWS) and _static_shape(user) == (b, h, length, ev):
                    replace(user, out)
            if node.users:
                replace(node, emit(graph, aten.reshape.default, out, [b * h, length, ev]))
            kind = "causal, " if causal else "masked, " if mask is not None else ""
            kind += f"GQA {h // n_rep} K/V heads, " if n_rep > 1 else ""
            return (
                f"flash attention ({kind}{dtype}, L={length}, S={keys}, scale {scale:.4g}): "
                f"{choice.describe()}"
            )

        return rewrite


def _scaled_scores(node: object) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """``(bmm, scale, nodes)`` for ``view(bmm) [* c | / c]`` of 4-D scores; None otherwise."""
    scale, nodes = 1.0, []
    if is_op(node, aten.mul.Tensor) and is_float_scalar(node.args[1]):
        scale, nodes, node = float(node.args[1]), [node], node.args[0]
    elif is_op(node, aten.div.Tensor) and is_float_scalar(node.args[1]) and node.args[1] != 0:
        scale, nodes, node = 1.0 / float(node.args[1]), [node], node.args[0]
    if not is_op(node, *VIEWS):
        return None
    first = node.args[0]
    shape = _static_shape(node)
    if not is_op(first, aten.bmm.default) or shape is None or len(shape) != 4:
        return None
    if _static_shape(first) != (shape[0] * shape[1], shape[2], shape[3]):
        return None
    return first, scale, [*nodes, node, first]
