"""The transformers models' training loss: output head + cross-entropy in row chunks.

The chunked computation is npu-core's (:func:`npu_core.chunked_ce.chunked_linear_cross_entropy`:
the ``[tokens, vocab]`` logits never exist whole, backward recomputes each chunk). What this
module adds is the trainer's policy for a batch without a single target to learn: its loss is 0
with zero gradients rather than the ``0 / 0 = nan`` of ``F.cross_entropy``, so one rank's fully
masked micro-batch cannot turn every rank's reduced gradients into nan.
"""

from __future__ import annotations

from torch import Tensor

from npu_core import chunked_ce
from npu_core.chunked_ce import DEFAULT_CHUNK_ROWS

__all__ = ["DEFAULT_CHUNK_ROWS", "chunked_linear_cross_entropy"]


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
        weight: ``[V, H]`` output-head weight, ``hidden``'s dtype.
        target: ``[...]`` class indices matching ``hidden``'s leading shape.
        bias: optional ``[V]`` head bias.
        chunk_rows: tokens per chunk (memory vs. GEMM size).
        ignore_index: targets with this value contribute neither loss nor gradient.
        softcap: logits become ``softcap * tanh(logits / softcap)`` first (Gemma's final
            logit soft-capping); None leaves them alone.

    Returns:
        An fp32 scalar: the mean over non-ignored targets, 0 (zero gradients) if all are ignored.
    """
    total = chunked_ce.chunked_linear_cross_entropy(
        hidden, weight, target, bias, ignore_index=ignore_index, reduction="sum",
        softcap=softcap, chunk_rows=chunk_rows,
    )  # fmt: skip
    return total / (target != ignore_index).sum().clamp(min=1)
