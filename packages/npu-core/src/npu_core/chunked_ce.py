"""Linear + cross-entropy in row chunks, so that the ``[tokens, vocab]`` logits never exist whole.

An LM head's loss ``F.cross_entropy(F.linear(h, w, b), y)`` materialises ``[tokens, vocab]``
logits, and autograd keeps a tensor of that size for backward: 8k tokens x 152k vocab in fp32 is
5 GB, more than every other activation. Here the forward computes the logits one chunk of rows at
a time and keeps only each row's log-sum-exp (``[tokens]`` fp32); the backward recomputes each
chunk's logits and folds ``softmax - onehot`` into the gradients of the hidden states, the weight
and the bias. The price is the head's forward GEMM once more, in backward.

Folding the gradients in during the forward instead (Liger's fused linear cross-entropy) saves
that GEMM but holds an fp32 ``[vocab, hidden]`` weight gradient and a ``[tokens, hidden]`` one
from the forward to the backward, at the step's memory peak (under FSDP2 the unsharded size, on
every rank); it serves only a scalar loss, and does the backward's work when none follows.

Both halves are custom ops, ``npu_core::chunked_ce_forward`` and ``npu_core::chunked_ce_backward``,
opaque to ``torch.compile``: :func:`chunked_linear_cross_entropy` is the autograd-aware entry for
models, and a graph pass can put the two ops in place of a traced head and loss (mfusion's
joint-graph rewrite does).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from torch import Tensor

Reduction = Literal["mean", "sum", "none"]
"""As ``F.cross_entropy``'s ``reduction``; ignored targets count in none of them."""

DEFAULT_CHUNK_ROWS = 1024
"""Tokens per chunk: one ``[1024, vocab]`` fp32 block, 600 MB at a 150k vocabulary."""


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    softcap: float | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target``, computed in row chunks.

    Equals ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)``, values
    and gradients, to fp32 rounding (the chunks sum in another order): mean over the
    non-ignored targets (0 / 0 = nan when all are ignored, as there), their sum, or one loss
    per token (0 where ignored).

    Args:
        hidden: ``[..., H]`` final hidden states, fp32 / bf16 / fp16 (leading dims are tokens).
        weight: ``[V, H]`` output-head weight (``nn.Linear`` layout), the dtype of ``hidden``.
        target: ``[...]`` integer class indices, ``hidden``'s leading shape.
        bias: optional ``[V]`` head bias.
        ignore_index: targets with this value contribute neither loss nor gradient.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        softcap: logits become ``softcap * tanh(logits / softcap)`` first (Gemma's final logit
            soft-capping); None leaves them alone.
        chunk_rows: tokens per chunk: the peak extra memory is one ``[chunk_rows, V]`` fp32
            block; smaller chunks make smaller GEMMs.

    Returns:
        fp32: a scalar for ``"mean"`` and ``"sum"``, ``target``'s shape for ``"none"``.

    Raises:
        ValueError: mismatched shapes or dtypes, an unknown reduction, ``chunk_rows < 1`` or a
            softcap that is not positive.
        TypeError: targets that are not integer class indices.
    """
    _check_inputs(hidden, weight, target, bias)
    if reduction not in get_args(Reduction):
        raise ValueError(f"reduction={reduction!r}: choose one of {', '.join(get_args(Reduction))}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    loss: Tensor = chunked_ce_forward(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), ignore_index,
        reduction, softcap, chunk_rows,
    )[0]  # fmt: skip
    return loss.view(target.shape) if reduction == "none" else loss


def _check_inputs(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: weight must be "
            "[vocab, hidden size] and the last dims (hidden size) must match"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}: cast one")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias {tuple(bias.shape)} {bias.dtype} must be [vocab] = [{weight.shape[0]}] in "
            f"the weight's dtype {weight.dtype}"
        )
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target {tuple(target.shape)} must have hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    if target.dtype.is_floating_point or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")


def _row_slices(rows: int, chunk_rows: int) -> list[slice]:
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return [slice(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


def _logits_into(out: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``hidden @ weight.T (+ bias)`` written into ``out`` (fp32) and returned.

    Every chunk reuses one ``out`` buffer: on CPU a fresh ``[rows, vocab]`` block per chunk is a
    fresh mapping whose pages fault in again (~10% of the head's time at a 152k vocabulary).
    """
    if out.dtype == hidden.dtype:
        if bias is None:
            return torch.mm(hidden, weight.t(), out=out)
        return torch.addmm(bias, hidden, weight.t(), out=out)
    if bias is None:
        return out.copy_(torch.mm(hidden, weight.t()))
    return out.copy_(torch.addmm(bias, hidden, weight.t()))


def _logsumexp_(logits: Tensor) -> Tensor:
    """Each row's log-sum-exp, overwriting ``logits`` (``torch.logsumexp`` allocates a temporary
    of the input's size)."""
    peak = logits.amax(1, keepdim=True)
    peak.masked_fill_(~torch.isfinite(peak), 0.0)  # all -inf (or inf) rows: no inf - inf = nan
    return logits.sub_(peak).exp_().sum(1).log_().add_(peak.squeeze(1))


def _chunk_buffer(hidden: Tensor, weight: Tensor, chunk_rows: int) -> Tensor:
    return hidden.new_empty(min(chunk_rows, hidden.shape[0]), weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("npu_core::chunked_ce_forward", mutates_args=())
def chunked_ce_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    softcap: float | None,
    chunk_rows: int,
) -> tuple[Tensor, Tensor]:
    """The loss of ``hidden [N, H] @ weight [V, H].T (+ bias [V])`` against ``target [N]`` and
    the per-row log-sum-exp ``[N]`` (fp32, all the backward needs besides the inputs)."""
    rows = hidden.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    losses = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    keep = target != ignore_index
    safe_target = torch.where(keep, target, 0)
    buffer = _chunk_buffer(hidden, weight, chunk_rows)
    for part in _row_slices(rows, chunk_rows):
        logits = _logits_into(buffer[: part.stop - part.start], hidden[part], weight, bias)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        picked = logits.gather(1, safe_target[part, None]).squeeze(1)
        lse[part] = _logsumexp_(logits)
        losses[part] = torch.where(keep[part], lse[part] - picked, 0.0)
    if reduction == "none":
        return losses, lse
    total = losses.sum()
    # a tensor division, not int(): no host sync, and 0 / 0 = nan as F.cross_entropy gives
    return (total / keep.sum() if reduction == "mean" else total), lse


@chunked_ce_forward.register_fake
def _(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    softcap: float | None,
    chunk_rows: int,
) -> tuple[Tensor, Tensor]:
    rows = hidden.shape[0]
    loss = hidden.new_empty((rows,) if reduction == "none" else (), dtype=torch.float32)
    return loss, hidden.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("npu_core::chunked_ce_backward", mutates_args=())
def chunked_ce_backward(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    reduction: str,
    softcap: float | None,
    chunk_rows: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`chunked_ce_forward`'s loss for the incoming ``grad_loss`` (a scalar,
    ``[N]`` for ``"none"``): of the hidden states ``[N, H]``, of the weight ``[V, H]`` and of the
    bias ``[V]``, each in its input's dtype; one not needed is returned empty (``[0]``)."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    keep = target != ignore_index
    scale = grad_loss.float()
    if reduction == "mean":
        scale = scale / keep.sum()
    row_scale = torch.where(keep, scale, 0.0)  # d loss / d (each row's loss), [N]
    safe_target = torch.where(keep, target, 0)
    need_bias = need_bias and bias is not None
    grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0)
    # fp32 accumulators: bf16 sums over many chunks would lose the small contributions
    grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if need_weight else None
    grad_bias = hidden.new_zeros(vocab, dtype=torch.float32) if need_bias else None
    buffer = _chunk_buffer(hidden, weight, chunk_rows)
    for part in _row_slices(rows, chunk_rows):
        chunk, scale_rows = hidden[part], row_scale[part]
        logits = _logits_into(buffer[: part.stop - part.start], chunk, weight, bias)
        slope = None
        if softcap is not None:  # d(softcap * tanh(raw / softcap)) / d raw = 1 - tanh^2
            capped = logits.div_(softcap).tanh_()
            slope = 1.0 - capped.square()
            capped.mul_(softcap)
        # softmax - onehot. The rows' gradients scale the [rows, H] factors of the GEMMs below
        # rather than this [rows, vocab] block: one pass over it fewer. Ignored rows scale by 0.
        grad_logits = logits.sub_(lse[part, None]).exp_()
        positions = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[positions, safe_target[part]] -= 1.0
        if slope is not None:
            grad_logits.mul_(slope)
        if grad_bias is not None:
            grad_bias.addmv_(grad_logits.t(), scale_rows)
        grad_logits = grad_logits.to(weight.dtype)
        if need_hidden:
            grad_hidden[part] = torch.mm(grad_logits, weight).float().mul_(scale_rows[:, None])
        if grad_weight is not None:
            scaled_rows = (chunk.float() * scale_rows[:, None]).to(chunk.dtype)
            _accumulate(grad_weight, grad_logits.t(), scaled_rows)
        del slope, grad_logits
    return (
        grad_hidden,
        hidden.new_empty(0) if grad_weight is None else grad_weight.to(weight.dtype),
        hidden.new_empty(0) if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
    )


def _accumulate(total: Tensor, left: Tensor, right: Tensor) -> None:
    """``total += left @ right``, in place where the dtypes allow (one fp32 pass, no temporary)."""
    if left.dtype == total.dtype:
        total.addmm_(left, right)
    else:
        total += torch.mm(left, right)


@chunked_ce_backward.register_fake
def _(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    reduction: str,
    softcap: float | None,
    chunk_rows: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need_weight else hidden.new_empty(0),
        bias.new_empty(bias.shape) if need_bias and bias is not None else hidden.new_empty(0),
    )


def _save_for_backward(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    hidden, weight, bias, target, ignore_index, reduction, softcap, chunk_rows = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[1])
    ctx.options = (ignore_index, reduction, softcap, chunk_rows)


def _backward(ctx: Any, grad_loss: Tensor, _grad_lse: Tensor) -> tuple[Tensor | None, ...]:
    hidden, weight, bias, target, lse = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    grads = chunked_ce_backward(
        grad_loss, hidden, weight, bias, target, lse, *ctx.options, need_hidden, need_weight,
        need_bias,
    )  # fmt: skip
    needed = (need_hidden, need_weight, need_bias)
    return *(g if need else None for g, need in zip(grads, needed, strict=True)), *[None] * 5


chunked_ce_forward.register_autograd(_backward, setup_context=_save_for_backward)
