"""The train job's model specs: one is chosen per configuration, each checks layouts against its
own model, and a transformers model's config.json is read once per process however many checks
and builds follow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from hyperparallel.parallel.mesh import ParallelDims, parse_mesh
from hyperparallel.train import job
from hyperparallel.train.config import load_config
from hyperparallel.train.hf_model import TransformersSpec
from hyperparallel.train.model import MoESpec
from hyperparallel.train.presets import debug
from hyperparallel.train.registry import model_spec
from packages.hyperparallel.tests.tiny_hf import QWEN3_MOE, TINY_HF_SHAPE


@pytest.fixture
def tiny_moe(tmp_path: Path) -> Path:
    """A Qwen3-MoE config.json (4 experts, 2 blocks), no weights and no tokenizer."""
    transformers.Qwen3MoeConfig(**TINY_HF_SHAPE, **QWEN3_MOE).save_pretrained(tmp_path)
    return tmp_path / "config.json"


@pytest.fixture
def config_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every folder ``transformers.AutoConfig.from_pretrained`` is asked to read."""
    reads: list[Path] = []
    original = transformers.AutoConfig.from_pretrained

    def counted(folder, *args, **kwargs):
        reads.append(Path(folder))
        return original(folder, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", counted)
    return reads


def test_the_spec_follows_the_configured_model(tiny_moe: Path):
    """No ``hf.source``: the built-in MoE; with one: the transformers model it names."""
    moe = model_spec(debug())
    assert isinstance(moe, MoESpec) and moe.n_layers == debug().model.n_layers
    cfg = load_config(debug(), overrides=[f"hf.source={str(tiny_moe)!r}"])
    hf = model_spec(cfg)
    assert isinstance(hf, TransformersSpec)
    assert (hf.n_layers, hf.model.architecture) == (2, "Qwen3MoeForCausalLM")


@pytest.mark.parametrize(
    ("overrides", "mesh", "message"),
    [
        (["data.global_batch_size=6"], "ep=4", "global_batch_size=6 is not divisible by the 4"),
        (["parallel.microbatches=3"], "pp=2,dp_shard=2", "microbatches=3 must divide the 4"),
        (["model.n_experts=6"], "ep=2,dp_shard=2", "n_experts=6 must be divisible by ep x"),
        ([], "pp=2,dp_shard=2", "model.n_layers=1 is fewer than the 2 pipeline stages"),
        (
            ["model.n_layers=4", "parallel.pp_schedule='dualpipev'", "parallel.microbatches=2"],
            "pp=2,dp_shard=2",
            "microbatches=2 is below the 4 stages",
        ),
        (
            ["parallel.pp_early_recompute=true", "parallel.pp_schedule='interleaved_1f1b'"],
            "pp=2,dp_shard=2",
            "pp_early_recompute needs a pp dimension and --pp-schedule 1f1b or dualpipev",
        ),
        (
            ["parallel.pp_early_recompute=true", "model.n_layers=2"],
            "pp=2,dp_shard=2",
            "pp_early_recompute has nothing to replay with --activation none",
        ),
    ],
)
def test_moe_layout_conflicts_are_named(overrides, mesh, message):
    """Settings that do not fit the mesh are refused before ranks start, naming both."""
    spec = model_spec(load_config(debug(), overrides=overrides))
    with pytest.raises(ValueError, match=message):
        spec.check_layout(parse_mesh(mesh, 4))


def test_moe_layout_returns_the_local_batch():
    """A layout that fits gives the samples each data-parallel rank takes per step."""
    spec = model_spec(
        load_config(debug(), overrides=["data.global_batch_size=16", "model.n_layers=2"])
    )
    assert spec.check_layout(ParallelDims(ep=2, dp_shard=2)) == 4
    assert spec.check_layout(ParallelDims(pp=2, dp_shard=2)) == 8


@pytest.mark.parametrize(
    ("mesh", "world", "message"),
    [
        ("pp=4", 4, "is fewer than the 4 pipeline stages"),
        (
            "ep=2,dp_shard=4",
            8,
            "--model num_local_experts=4 must be divisible by ep x dp_shard = 2 x 4",
        ),
    ],
)
def test_transformers_layout_conflicts_are_named(tiny_moe: Path, mesh, world, message):
    """The transformers spec checks a pipeline against its own blocks (2 here, fewer than 4
    stages) and its own expert count, not ``model.n_experts`` (the built-in MoE's, which would
    pass here)."""
    overrides = [f"hf.source={str(tiny_moe)!r}", "model.n_experts=8"]
    spec = model_spec(load_config(debug(), overrides=overrides))
    with pytest.raises(ValueError, match=message):
        spec.check_layout(parse_mesh(mesh, world))
    assert spec.check_layout(parse_mesh("ep=2,dp_shard=2", 4)) == debug().data.batch_size


def test_job_check_reads_the_model_config_once(tiny_moe: Path, config_reads: list[Path]):
    """Before ranks start, the model, the layout and the data are checked with one read of
    config.json (the spec holds what it read)."""
    cfg = load_config(
        debug(),
        overrides=[f"hf.source={str(tiny_moe)!r}", "parallel.nproc=2", "parallel.mesh='ep=2'"],
    )
    job.check(cfg)
    assert config_reads == [tiny_moe.parent]


def test_a_rank_builds_from_the_config_it_read_once(
    tiny_moe: Path, config_reads: list[Path], tmp_path: Path
):
    """One rank's whole start (spec, data, layout check, model built and sharded on a one-rank
    mesh) reads config.json once, and the model it trains is the one that config describes."""
    cfg = load_config(debug(), overrides=[f"hf.source={str(tiny_moe)!r}"])
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        spec = model_spec(cfg)
        spec.batches()
        dims = parse_mesh("fsdp", 1)
        spec.check_layout(dims)
        net = spec.build(dims.build("cpu"), torch.device("cpu"))
        blocks = [name for name, _ in net.owner.named_parameters() if ".layers." in name]
    finally:
        dist.destroy_process_group()
    assert config_reads == [tiny_moe.parent]
    layers = {name.split(".layers.")[1].split(".")[0] for name in blocks}
    assert layers == {"0", "1"}


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.n_layers=3", "model.n_experts=8", "model.top_k=2", "model.vocab_size=300"]],
)
def test_moe_parameter_count_matches_the_built_model(overrides):
    """The count the memory check uses, computed from the settings alone, is the number of
    parameters of the model a rank builds."""
    spec = MoESpec(load_config(debug(), overrides=overrides))
    count, settings = spec.parameter_count()
    built = spec.build_module(torch.device("cpu"))
    assert count == sum(p.numel() for p in built.parameters())
    assert settings.startswith(f"the built-in MoE (model.dim={spec.cfg.model.dim},")


def test_memory_check_counts_one_fp32_copy_per_rank():
    """Refused when ranks x parameters x 4 bytes exceed the memory, naming all three."""
    from hyperparallel.train.memory import check_host_memory

    check_host_memory(1000, 4, "a model", available=16_000)
    with pytest.raises(ValueError, match=r"a model has 1,000 parameters; 5 ranks each build it"):
        check_host_memory(1000, 5, "a model", available=16_000)


def test_memory_check_counts_two_bytes_per_parameter_in_bf16():
    """``dtype=bf16`` builds the model in bf16: 8 ranks of 1,000 parameters fit 16,000 bytes."""
    from hyperparallel.train.memory import check_host_memory

    check_host_memory(1000, 8, "a model", available=16_000, dtype="bf16")
    with pytest.raises(ValueError, match=r"9 ranks each build it whole in bf16 at start-up"):
        check_host_memory(1000, 9, "a model", available=16_000, dtype="bf16")


def test_bf16_builds_the_fp32_weights_rounded():
    """``dtype=bf16``: every parameter of the built-in MoE is the fp32 build's value in bf16;
    the RoPE tables stay fp32 (positions are rotated in fp32)."""
    fp32 = MoESpec(debug()).build_module(torch.device("cpu"))
    spec = MoESpec(load_config(debug(), overrides=["dtype=bf16"]))
    bf16 = spec.build_module(torch.device("cpu"))
    assert spec.dtype is torch.bfloat16
    pairs = zip(fp32.named_parameters(), bf16.named_parameters(), strict=True)
    for (name, ref), (_, param) in pairs:
        assert param.dtype is torch.bfloat16, name
        assert torch.equal(param, ref.to(torch.bfloat16)), name
    assert bf16.rope_cos.dtype is torch.float32


def test_expert_dispatch_follows_parallel_ep_chunks(monkeypatch: pytest.MonkeyPatch):
    """``parallel.ep_chunks`` reaches the expert-parallel dispatch of the built-in MoE."""
    import hyperparallel.train.model as moe_model

    seen = []
    monkeypatch.setattr(
        moe_model, "apply_expert_parallel", lambda module, meshes, config: seen.append(config)
    )
    spec = model_spec(load_config(debug(), overrides=["parallel.ep_chunks=3"]))
    spec.place_experts(nn.Identity(), meshes=None)
    assert [config.chunks for config in seen] == [3]
    with pytest.raises(ValueError, match="ep_chunks"):
        load_config(debug(), overrides=["parallel.ep_chunks=0"])


def test_expert_dispatch_follows_parallel_ep_local_first(monkeypatch: pytest.MonkeyPatch):
    """``parallel.ep_local_first`` reaches the expert-parallel dispatch of the built-in MoE, and
    is refused together with ``ep_chunks`` above 1 when the configuration loads."""
    import hyperparallel.train.model as moe_model

    seen = []
    monkeypatch.setattr(
        moe_model, "apply_expert_parallel", lambda module, meshes, config: seen.append(config)
    )
    spec = model_spec(load_config(debug(), overrides=["parallel.ep_local_first=true"]))
    spec.place_experts(nn.Identity(), meshes=None)
    assert [(config.chunks, config.local_first) for config in seen] == [(1, True)]
    with pytest.raises(ValueError, match="choose one overlap"):
        load_config(debug(), overrides=["parallel.ep_local_first=true", "parallel.ep_chunks=2"])
