"""Parallelize plans found by class, checked against hand-written routing of transformers models."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from torch import nn

from hyperparallel.models.families import (
    FamilyPlan,
    UnknownArchitectureError,
    families,
    plan_for,
    register,
    unregister,
)


def _build(shape: dict, cls_name: str, config_name: str, **extra) -> nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**shape, **extra})
    return getattr(transformers, cls_name)(config)


def _suffixes(names) -> set[str]:
    """``model.layers.1.self_attn.q_proj.weight`` -> ``self_attn.q_proj.weight`` (per block)."""
    return {re.sub(r"^model\.layers\.\d+\.", "", n) for n in names}


# What a person reading each architecture's modeling file expects, written out by hand.
EXPECTED = {
    "Qwen3ForCausalLM": (
        ("Qwen3Config", {}),
        {
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        },
        set(),
    ),
    "Qwen3MoeForCausalLM": (
        (
            "Qwen3MoeConfig",
            {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        ),
        {
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
        },
        {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"},
    ),
    "GptOssForCausalLM": (
        ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        {
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
        },
        {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"},
    ),
    "DeepseekV3ForCausalLM": (
        (
            "DeepseekV3Config",
            {
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "moe_intermediate_size": 16,
                "first_k_dense_replace": 1,
                "n_shared_experts": 1,
                "q_lora_rank": 16,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 4,
                "qk_nope_head_dim": 4,
                "v_head_dim": 8,
            },
        ),
        {
            "self_attn.q_a_proj.weight",
            "self_attn.q_b_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_b_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",  # the dense first block
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight",
            "mlp.shared_experts.down_proj.weight",
        },
        {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"},
    ),
}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_routing_matches_the_architecture(arch: str, tiny_hf_shape: dict):
    (config_name, extra), muon, experts = EXPECTED[arch]
    model = _build(tiny_hf_shape, arch, config_name, **extra)
    plan = plan_for(model)
    routing = plan.route(model)
    assert _suffixes(routing.muon) == muon
    assert _suffixes(routing.experts) == experts
    names = [n for n, _ in model.named_parameters()]
    # every trainable parameter is routed exactly once
    assert sorted(routing.muon + routing.adamw) == sorted(names)
    assert len(plan.blocks(model)) == tiny_hf_shape["num_hidden_layers"]
    for name in routing.experts:  # expert stacks: [E, M, N], E on dim 0 (what EP shards)
        assert model.get_parameter(name).shape[0] == 4


def test_subclasses_inherit_their_base_plan():
    base = transformers.Qwen3ForCausalLM

    class MyQwen(base):  # a user's subclass of a supported architecture
        pass

    assert plan_for(MyQwen).name == "dense"


def test_unknown_architecture_lists_families_and_how_to_register():
    class Mystery(nn.Module):
        pass

    with pytest.raises(UnknownArchitectureError) as err:
        plan_for(Mystery())
    message = str(err.value)
    assert "no parallelize plan for Mystery" in message
    for family in families():
        assert family.name in message
    assert "register(FamilyPlan(" in message


def test_registering_a_family_and_strict_routing():
    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.blocks[0].register_parameter("odd", nn.Parameter(torch.zeros(2, 2, 2)))

    plan = FamilyPlan("toy", ("Toy",), "dense", layers="blocks")
    register(plan)
    try:
        assert plan_for(Toy()) is plan
        with pytest.raises(ValueError, match=r"blocks\.0\.odd: a 3-D parameter"):
            plan.route(Toy())  # a 3-D tensor that is not an expert stack is not guessed
        with pytest.raises(ValueError, match="already belongs to family 'toy'"):
            register(FamilyPlan("toy2", ("Toy",), "dense"))
    finally:
        unregister("toy")
    with pytest.raises(UnknownArchitectureError):
        plan_for(Toy)


def test_blocks_path_must_exist():
    plan = FamilyPlan("x", ("X",), "dense", layers="model.layers")
    expected = r"expects its blocks at model\.model\.layers"
    with pytest.raises(UnknownArchitectureError, match=expected):
        plan.blocks(nn.Linear(2, 2))
