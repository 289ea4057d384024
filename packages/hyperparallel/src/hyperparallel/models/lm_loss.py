"""Output head + cross-entropy in row chunks, so ``[tokens, vocab]`` logits never exist whole.

With vocabularies of 150k+ the logits of one micro-batch dwarf every activation of the model: 8k
tokens x 152k vocab in fp32 is 5 GB, and autograd keeps them (and the softmax) for backward. Here
the loss and both gradients are computed chunk by chunk during the forward pass (as Liger's fused
linear cross-entropy does): per chunk, logits in fp32, log-sum-exp, loss, and the logits'
gradient ``softmax - onehot`` folded at once into ``grad_hidden`` and ``grad_weight``. Peak extra
memory is one chunk of logits plus the two gradient buffers, whatever the sequence length.
Backward only scales the stored gradients by the incoming one.

The result equals ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` (mean
over the non-ignored targets) to fp32 rounding, values and gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

DEFAULT_CHUNK_ROWS = 1024
"""Tokens per chunk: a [1024, vocab] fp32 block, 600 MB at 150k vocab, ~1 ms of GEMM per GFLOP."""


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target``, chunked.

    Args:
        hidden: ``[..., H]`` final hidden states (any leading shape; flattened to tokens).
        weight: ``[V, H]`` output-head weight.
        target: ``[...]`` class indices matching ``hidden``'s leading shape.
        bias: optional ``[V]`` head bias.
        chunk_rows: tokens per chunk (memory vs. GEMM size).
        ignore_index: targets with this value contribute neither loss nor gradient.
        softcap: logits become ``softcap * tanh(logits / softcap)`` first (Gemma's final
            logit soft-capping); None leaves them alone.

    Returns:
        A scalar: the mean over non-ignored targets (0 with a zero gradient if all are ignored).
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: the last dims "
            "(hidden size) must match"
        )
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target {tuple(target.shape)} must have hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    loss: Tensor = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), chunk_rows,
        ignore_index, softcap,
    )  # fmt: skip
    return loss


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target: Tensor,
        chunk_rows: int,
        ignore_index: int,
        softcap: float | None,
    ) -> Tensor:
        valid = target != ignore_index
        count = int(valid.sum())
        scale = 1.0 / max(count, 1)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if bias is not None and need_bias else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h, t, keep = hidden[rows], target[rows], valid[rows]
            logits = (h @ weight.T).float()
            if bias is not None:
                logits += bias.float()
            if softcap is not None:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            safe_t = torch.where(keep, t, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_t[:, None]).squeeze(1)
            total += ((lse - picked) * keep).sum()
            # d loss / d logits = (softmax - onehot) / count, zero on ignored rows
            grad_logits = torch.exp_(logits.sub_(lse[:, None]))
            grad_logits[torch.arange(len(t), device=t.device), safe_t] -= 1.0
            grad_logits *= (keep * scale)[:, None]
            if softcap is not None:  # chain rule through softcap * tanh(z / softcap)
                grad_logits *= 1.0 - capped.square_()
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            # Free this chunk before the next one's logits exist: peak stays at one chunk.
            del logits, grad_logits
            if softcap is not None:
                del capped
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias))
        )
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)  # type: ignore[attr-defined]
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            grad_hidden * grad_output.to(grad_hidden.dtype) if need_hidden else None,
            (grad_weight * grad_output).to(weight_dtype) if need_weight else None,
            (grad_bias * grad_output).to(bias_dtype) if need_bias and bias_dtype else None,
            None,
            None,
            None,
            None,
        )
