"""Transformers decoders cut into pipeline stages: the stages run in order reproduce the library's
own forward for every architecture a family lists as ``pipelined``, and the rest are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from hyperparallel.models.families import families
from hyperparallel.models.hf import build_causal_lm
from hyperparallel.parallel.hf_pipeline import DecoderStage, pipeline_refusal
from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.parallel.pipeline import split_layers
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from hyperparallel.train.registry import model_spec
from packages.hyperparallel.tests.tiny_hf import FAMILIES, MORE_MOE_FAMILIES, TINY_HF_SHAPE

WINDOW = 4
"""A sliding window shorter than the test sequence, so sliding-window masks differ from causal."""

PIPELINED: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {"sliding_window": WINDOW}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": FAMILIES["dense"],
    "Phi3ForCausalLM": ("Phi3Config", {"pad_token_id": 0, "sliding_window": WINDOW}),
    "Gemma3ForCausalLM": (  # a rotary embedding per layer type, soft-capped logits
        "Gemma3TextConfig",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "final_logit_softcapping": 5.0,
        },
    ),
    "Qwen3MoeForCausalLM": FAMILIES["moe"],
    "Glm4MoeForCausalLM": MORE_MOE_FAMILIES["glm-4.5"],
    "MiniMaxM2ForCausalLM": MORE_MOE_FAMILIES["minimax-m2"],
    "GptOssForCausalLM": (
        "GptOssConfig",
        {
            **FAMILIES["gpt-oss"][1],
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "DeepseekV3ForCausalLM": FAMILIES["mla-moe"],
    "DeepseekV32ForCausalLM": (
        "DeepseekV32Config",
        {
            **FAMILIES["mla-moe"][1],
            "num_key_value_heads": 4,  # MLA: one key/value head per query head
            "index_topk": 4,  # below the sequence: the indexer picks keys, reading the mask
            "index_head_dim": 8,
            "index_n_heads": 2,
        },
    ),
}
"""Every pipelined architecture -> (config class, fields over TINY_HF_SHAPE with 4 blocks)."""


def _config(entry: tuple[str, dict[str, Any]]) -> Any:
    cls, extra = entry
    return getattr(transformers, cls)(**{**TINY_HF_SHAPE, "num_hidden_layers": 4, **extra})


def test_every_pipelined_architecture_is_checked_here():
    listed = {arch for plan in families() for arch in plan.pipelined}
    assert listed == set(PIPELINED)


@pytest.mark.parametrize("architecture", sorted(PIPELINED))
def test_stages_in_order_reproduce_the_library_forward(architecture: str):
    """Independent reference: the transformers model's own logits for the same tokens. Three
    stages over four blocks put an embedding, a middle and a head stage in the chain, so each
    stage's own rotary embedding and masks (sliding windows shorter than the sequence included)
    are what its blocks see."""
    lm = build_causal_lm(_config(PIPELINED[architecture]), seed=0).eval()
    assert type(lm.model).__name__ == architecture
    tokens = torch.randint(0, TINY_HF_SHAPE["vocab_size"], (2, 12), generator=torch.Generator())
    ranges = split_layers(4, 3)
    stages = [DecoderStage(lm, r, i == 0, i == len(ranges) - 1, 0.0) for i, r in enumerate(ranges)]
    with torch.no_grad():
        want = lm.model(input_ids=tokens).logits
        x = tokens
        for stage in stages:
            x = stage(x)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


def test_stage_balance_loss_reaches_the_routers_gradient():
    """A Qwen3-MoE stage attaches its blocks' balance loss to the hidden state's gradient: the
    router weights get a gradient from it even though the stage's output gradient is zero."""
    lm = build_causal_lm(_config(FAMILIES["moe"]), seed=0)
    stage = DecoderStage(lm, range(0, 2), True, False, balance_scale=0.5)
    out = stage(torch.randint(0, TINY_HF_SHAPE["vocab_size"], (2, 12)))
    out.backward(torch.zeros_like(out))
    router = lm.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        (
            "qwen3-next",
            {},
            "Qwen3NextForCausalLM is not cut into pipeline stages (its family's pipelined "
            "architectures: Qwen3MoeForCausalLM",
        ),
        ("dense", {"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ],
)
def test_pp_refuses_what_is_not_cut_into_stages(tmp_path, name, overrides, message):
    cls, extra = {**FAMILIES, **MORE_MOE_FAMILIES}[name]
    getattr(transformers, cls)(**TINY_HF_SHAPE, **extra, **overrides).save_pretrained(tmp_path)
    spec = model_spec(load_config(debug(), overrides=[f"hf.source={str(tmp_path)!r}"]))
    with pytest.raises(ValueError, match="pp=2 with --model") as error:
        spec.check_layout(parse_mesh("pp=2", 2))
    assert message in str(error.value)


def test_pipelined_architectures_pass_the_layout_check(tmp_path):
    transformers.Qwen3Config(**TINY_HF_SHAPE).save_pretrained(tmp_path)
    spec = model_spec(load_config(debug(), overrides=[f"hf.source={str(tmp_path)!r}"]))
    assert pipeline_refusal("Qwen3ForCausalLM", spec.model.config, ("Qwen3ForCausalLM",)) is None
    assert spec.check_layout(parse_mesh("pp=2", 2)) == 4
