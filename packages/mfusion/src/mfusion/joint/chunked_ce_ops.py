"""Linear + cross-entropy in row chunks: the two custom ops the ``chunked_cross_entropy`` joint
graph pass calls instead of the ``[tokens, vocab]`` logits, log-softmax and their gradient.

``mfusion::chunked_ce_forward`` computes, chunk of rows by chunk, the logits, their log-sum-exp
and the target logit, and returns the mean loss over the non-ignored targets and the per-row
log-sum-exp (``[tokens]`` fp32: all backward needs besides the inputs).
``mfusion::chunked_ce_backward`` recomputes each chunk's logits from the hidden states and the
head weight, turns them into ``(softmax - onehot) * grad / count`` and folds that chunk into the
gradients of the hidden states, the weight and the bias. Both are opaque to Inductor (a fake
implementation gives shapes), so AOTAutograd's partitioner saves only their inputs: never a
``[tokens, vocab]`` tensor. The price is the head's forward GEMM once more in backward.

The math is the same as ``F.cross_entropy(F.linear(h, w, b), target, ignore_index=i)`` with mean
reduction (0/0 = nan when every target is ignored, as eager); only the summation order of the
loss and the weight/bias gradients differs (per chunk, then across chunks), i.e. fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _chunk_logits(hidden: Tensor, weight_t: Tensor, bias: Tensor | None) -> Tensor:
    """``hidden @ weight_t (+ bias)`` for one chunk of rows, in fp32 (the loss's dtype)."""
    if bias is None:
        return torch.mm(hidden, weight_t).float()
    return torch.addmm(bias, hidden, weight_t).float()


def _row_slices(rows: int, chunk_rows: int) -> list[slice]:
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return [slice(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


@torch.library.custom_op("mfusion::chunked_ce_forward", mutates_args=())
def chunked_ce_forward(
    hidden: Tensor,
    weight_t: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    chunk_rows: int,
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy of ``hidden [N, H] @ weight_t [H, V] (+ bias [V])`` against
    ``target [N]``, and the per-row log-sum-exp ``[N]`` (fp32), one chunk of rows at a time."""
    rows = hidden.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for part in _row_slices(rows, chunk_rows):
        logits = _chunk_logits(hidden[part], weight_t, bias)
        chunk_lse = torch.logsumexp(logits, dim=1)
        labels = target[part]
        keep = labels != ignore_index
        picked = logits.gather(1, torch.where(keep, labels, 0).unsqueeze(1)).squeeze(1)
        total += torch.where(keep, chunk_lse - picked, 0.0).sum()
        lse[part] = chunk_lse
        del logits  # one chunk of logits alive at a time
    count = (target != ignore_index).sum().float()
    return total / count, lse


@chunked_ce_forward.register_fake
def _(
    hidden: Tensor,
    weight_t: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    chunk_rows: int,
) -> tuple[Tensor, Tensor]:
    loss = hidden.new_empty((), dtype=torch.float32)
    return loss, hidden.new_empty(hidden.shape[0], dtype=torch.float32)


@torch.library.custom_op("mfusion::chunked_ce_backward", mutates_args=())
def chunked_ce_backward(
    grad_loss: Tensor,
    hidden: Tensor,
    weight_t: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    chunk_rows: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`chunked_ce_forward`'s loss for the incoming ``grad_loss``: of the
    hidden states ``[N, H]``, of the weight in ``nn.Linear`` layout ``[V, H]`` and of the bias
    ``[V]``; an unneeded one is returned empty (``[0]``) and not computed."""
    rows = hidden.shape[0]
    vocab = weight_t.shape[1]
    keep_all = target != ignore_index
    scale = grad_loss.float() / keep_all.sum().float()
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    grad_weight = (
        torch.zeros(vocab, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        if need_weight
        else None
    )
    grad_bias = (
        torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if bias is not None else None
    )
    for part in _row_slices(rows, chunk_rows):
        chunk = hidden[part]
        # softmax - onehot, scaled by grad / count on kept rows, zero on ignored rows
        grad_logits = _chunk_logits(chunk, weight_t, bias).sub_(lse[part, None]).exp_()
        labels = target[part]
        keep = keep_all[part]
        row_scale = torch.where(keep, scale, 0.0)
        grad_logits.mul_(row_scale[:, None])
        positions = torch.arange(len(labels), device=labels.device)
        grad_logits[positions, torch.where(keep, labels, 0)] -= row_scale
        grad_logits = grad_logits.to(weight_t.dtype)
        if need_hidden:
            grad_hidden[part] = torch.mm(grad_logits, weight_t.t())
        if grad_weight is not None:
            grad_weight += torch.mm(grad_logits.t(), chunk).float()
        if grad_bias is not None:
            grad_bias += grad_logits.float().sum(0)
        del grad_logits
    weight_out = grad_weight.to(weight_t.dtype) if grad_weight is not None else hidden.new_empty(0)
    if grad_bias is not None and bias is not None:
        bias_out = grad_bias.to(bias.dtype)
    else:
        bias_out = hidden.new_empty(0)
    return grad_hidden, weight_out, bias_out


@chunked_ce_backward.register_fake
def _(
    grad_loss: Tensor,
    hidden: Tensor,
    weight_t: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    chunk_rows: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    vocab, width = weight_t.shape[1], hidden.shape[1]
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    grad_weight = weight_t.new_empty(vocab, width) if need_weight else hidden.new_empty(0)
    grad_bias = bias.new_empty(vocab) if bias is not None else hidden.new_empty(0)
    return grad_hidden, grad_weight, grad_bias
