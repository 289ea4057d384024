"""Tiny transformers configurations shared by the hyperparallel tests (test data, no tests).

Rank functions started by the forkserver find what they use by module-level lookup, so the
families live in this importable module rather than in a fixture. Tests import it as
``packages.hyperparallel.tests.tiny_hf``: the name pytest's ``--import-mode=importlib`` gives the
test modules themselves (the root ``pythonpath = ["."]`` makes it importable in the test process
and in every rank).
"""

from __future__ import annotations

from typing import Any

TINY_HF_SHAPE: dict[str, int] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}
"""A shape small enough for a CPU test step; each family adds its MoE / MLA fields on top."""

QWEN3_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("Qwen3Config", {}),
    "moe": ("Qwen3MoeConfig", QWEN3_MOE),
    "mla-moe": (
        "DeepseekV3Config",
        {
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "moe_intermediate_size": 16, "first_k_dense_replace": 1, "n_shared_experts": 1,
            "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
            "v_head_dim": 8, "head_dim": 4,  # MLA: RoPE on qk_rope_head_dim
        },
    ),
    "gpt-oss": (  # expert biases: [E, N] stacks sharded with the weights, stepped by AdamW
        "GptOssConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["full_attention"] * 2},
    ),
}  # fmt: skip
"""Family name -> (transformers config class name, fields added to TINY_HF_SHAPE)."""

MORE_MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "glm-4.5": (
        "Glm4MoeConfig",
        {
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        },
    ),
    "minimax-m2": ("MiniMaxM2Config", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-next": (
        "Qwen3NextConfig",
        {
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16, "linear_num_value_heads": 2,
            "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention", "full_attention"],
        },
    ),
}  # fmt: skip
"""The other registered MoE families (same experts contract), checked in slow tests."""
