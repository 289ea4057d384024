"""What each self-attention of a Wan transformer received: shared by the sequence-parallel tests,
which check that every rank attends over its share of the tokens only."""

from __future__ import annotations

import torch


def forward_counting_tokens(model, inputs: dict) -> tuple[torch.Tensor, list[int]]:
    """The model's output and the tokens each self-attention received (sequence length)."""
    seen: list[int] = []
    handles = [
        block.attn1.register_forward_pre_hook(
            lambda _m, args, kwargs: seen.append(
                (args[0] if args else kwargs["hidden_states"]).shape[1]
            ),
            with_kwargs=True,
        )
        for block in model.blocks
    ]
    try:
        sample = model(**inputs).sample
    finally:
        for handle in handles:
            handle.remove()
    return sample, seen
