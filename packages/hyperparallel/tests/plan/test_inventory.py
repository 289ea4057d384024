"""The planner's parameter inventory: the job's model on the meta device, its routing, expert
placement, pipeline stages and FSDP units, for the built-in MoE and a transformers MoE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from hyperparallel.parallel.mesh import MESH_DIMS, ParallelDims, parse_mesh
from hyperparallel.plan.inventory import mesh_coords, model_inventory
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from packages.hyperparallel.tests.tiny_hf import QWEN3_MOE, TINY_HF_SHAPE


def _moe(*overrides: str):
    return load_config(debug(), overrides=["model.n_layers=4", "data.batch_size=4", *overrides])


@pytest.fixture
def qwen3_moe(tmp_path: Path) -> Path:
    """A Qwen3-MoE config.json (4 experts, 4 blocks), no weights."""
    shape = {**TINY_HF_SHAPE, "num_hidden_layers": 4}
    transformers.Qwen3MoeConfig(**shape, **QWEN3_MOE).save_pretrained(tmp_path)
    return tmp_path / "config.json"


def test_builtin_moe_parameters_match_its_formula():
    """Names and shapes are the model's; the total is the spec's own closed-form count."""
    cfg = _moe()
    inv = model_inventory(cfg, parse_mesh("fsdp", 4))
    m = cfg.model
    block = 2 * m.dim + 4 * m.dim**2 + m.dim * m.n_experts + 3 * m.n_experts * m.dim * m.ffn_dim
    assert sum(p.numel for p in inv.params) == 2 * m.vocab_size * m.dim + m.n_layers * block + m.dim
    shapes = {p.name: p.shape for p in inv.params}
    assert shapes["layers.2.ffn.w_down"] == (m.n_experts, m.ffn_dim, m.dim)
    assert shapes["embed.weight"] == (m.vocab_size, m.dim)
    assert all(p.itemsize == 4 for p in inv.params)
    assert (inv.n_layers, inv.hidden, inv.n_experts, inv.top_k) == (4, m.dim, m.n_experts, m.top_k)
    assert inv.moe_layers == (0, 1, 2, 3)


def test_routing_placement_and_units_follow_the_job():
    """Under ep the expert stacks (and only they) are placed on the ep mesh; matrices in blocks
    go to Muon, embedding, head and norms to AdamW; each block is its own FSDP unit."""
    inv = model_inventory(_moe(), parse_mesh("ep=2,dp_shard=2", 4))
    by_name = {p.name: p for p in inv.params}
    experts = {p.name for p in inv.params if p.expert}
    assert experts == {
        f"layers.{i}.ffn.{w}" for i in range(4) for w in ("w_gate", "w_up", "w_down")
    }
    assert {p.name for p in inv.params if p.expert_stack} == experts
    adamw = {p.name for p in inv.params if p.optimizer == "adamw"}
    assert {"embed.weight", "lm_head.weight", "norm.weight", "layers.0.attn_norm.weight"} <= adamw
    assert by_name["layers.1.attn.qkv.weight"].optimizer == "muon"
    assert by_name["layers.3.ffn.w_up"].optimizer == "muon"
    assert by_name["layers.3.ffn.w_up"].fsdp_unit == "layers.3"
    assert by_name["embed.weight"].fsdp_unit == by_name["norm.weight"].fsdp_unit == ""


def test_no_ep_leaves_expert_stacks_to_fsdp():
    """Without ep no parameter is on the ep mesh, but the stacks are still known as stacks."""
    inv = model_inventory(_moe(), parse_mesh("2x2", 4))
    assert not any(p.expert for p in inv.params)
    assert sum(p.expert_stack for p in inv.params) == 12


@pytest.mark.parametrize(
    ("schedule", "pp", "held"),
    [
        ("1f1b", 2, {0: [0], 1: [1]}),
        ("interleaved_1f1b", 2, {0: [0, 2], 1: [1, 3]}),
        ("dualpipev", 2, {0: [0, 3], 1: [1, 2]}),
    ],
)
def test_pipeline_stages_are_the_jobs_split(schedule: str, pp: int, held: dict[int, list[int]]):
    """Four blocks on four stages: block i on stage i, the embedding on the first stage, the
    final norm and head on the last, and each pipeline rank holds the schedule's stages."""
    cfg = _moe(f"parallel.pp_schedule={schedule!r}", "parallel.microbatches=4")
    inv = model_inventory(cfg, parse_mesh(f"pp={pp}", pp))
    n_stages = 2 if schedule == "1f1b" else 4
    assert inv.n_stages == n_stages
    by_name = {p.name: p for p in inv.params}
    assert by_name["embed.weight"].stage == 0
    assert by_name["lm_head.weight"].stage == by_name["norm.weight"].stage == n_stages - 1
    for i in range(4):
        assert by_name[f"layers.{i}.attn.qkv.weight"].stage == i * n_stages // 4
    for rank, stages in held.items():
        assert inv.stages_of(rank) == stages
        assert all(inv.holder(s) == rank for s in stages)
    names_of = [{p.name for p in inv.params_of(r)} for r in range(pp)]
    assert set.union(*names_of) == set(by_name) and not set.intersection(*names_of)


def test_transformers_moe_inventory(qwen3_moe: Path):
    """A transformers model: the library's parameters (counted on a CPU build), its family's
    expert stacks on ep, its blocks as FSDP units, pipeline stages cut from its decoder."""
    cfg = load_config(
        debug(), overrides=[f"hf.source={str(qwen3_moe)!r}", "data.batch_size=4", "data.seq_len=16"]
    )
    inv = model_inventory(cfg, parse_mesh("pp=2,ep=2", 4))
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(qwen3_moe.parent)
    )
    expected = {f"model.{n}": tuple(p.shape) for n, p in reference.named_parameters()}
    assert {p.name: p.shape for p in inv.params} == expected
    experts = {p.name for p in inv.params if p.expert}
    assert experts == {
        f"model.model.layers.{i}.mlp.experts.{w}"
        for i in range(4)
        for w in ("gate_up_proj", "down_proj")
    }
    by_name = {p.name: p for p in inv.params}
    assert by_name["model.model.layers.2.self_attn.q_proj.weight"].stage == 1
    assert by_name["model.model.embed_tokens.weight"].stage == 0
    assert by_name["model.lm_head.weight"].stage == 1
    assert (
        by_name["model.model.layers.2.self_attn.q_proj.weight"].fsdp_unit == "model.model.layers.2"
    )
    assert by_name["model.model.layers.2.mlp.gate.weight"].optimizer == "adamw"  # the router
    assert (inv.n_experts, inv.top_k, inv.hidden) == (4, 2, TINY_HF_SHAPE["hidden_size"])


def test_a_layout_the_job_refuses_is_refused_the_same_way():
    """Experts that do not divide over ep x dp_shard: the job's own one-line refusal."""
    with pytest.raises(
        ValueError, match=r"model.n_experts=4 must be divisible by ep x dp_shard = 8 x 1"
    ):
        model_inventory(_moe(), parse_mesh("ep=8", 8))


@pytest.mark.parametrize("spec", ["pp=2,dp_replicate=3,ep=2,dp_shard=2", "ep=4,dp_shard=3"])
def test_mesh_coords_match_the_device_mesh_layout(spec: str):
    """Each rank's coordinates are where ``init_device_mesh`` puts it: the row-major layout of
    ``arange(world).reshape(sizes)``."""
    dims: ParallelDims = parse_mesh(spec, 24 if "pp" in spec else 12)
    grid = torch.arange(dims.world_size).reshape([getattr(dims, d) for d in MESH_DIMS])
    for rank in range(dims.world_size):
        coords = mesh_coords(dims, rank)
        assert int(grid[tuple(coords[d] for d in MESH_DIMS)]) == rank
