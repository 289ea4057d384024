"""The weight-file check of a transformers model folder: every layout ``from_pretrained`` loads
passes, and each file that does not fit the config is refused naming what differs. The
refusal through ``hyperparallel train`` (exit 2, nothing written) is in
``tests/train/test_failure_behaviour.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hyperparallel.models.hf_weights import check_weights, read_shapes
from packages.hyperparallel.tests.tiny_hf import QWEN3_MOE, TINY_HF_SHAPE


def _moe_config(**fields: Any) -> Any:
    return transformers.Qwen3MoeConfig(**{**TINY_HF_SHAPE, **QWEN3_MOE, **fields})


def _saved(folder: Path, config: Any, **save: Any) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, **save)
    return folder


@pytest.mark.parametrize(
    ("fields", "save"),
    [
        ({}, {}),
        ({}, {"save_original_format": False}),
        ({}, {"max_shard_size": "20KB"}),
        ({"tie_word_embeddings": True}, {}),
        ({"tie_word_embeddings": True}, {"save_original_format": False}),
    ],
    ids=["per-expert tensors", "fused expert stacks", "sharded", "tied head", "tied and fused"],
)
def test_folders_that_from_pretrained_loads_pass(tmp_path: Path, fields: dict, save: dict):
    """Each folder loads with ``from_pretrained`` without a missing or unexpected key (the
    library's own verdict) and passes the check."""
    config = _moe_config(**fields)
    folder = _saved(tmp_path, config, **save)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    check_weights(folder, config)


def test_a_tied_head_stored_anyway_passes(tmp_path: Path):
    """Older checkpoints of tied models hold the head as well as the embedding: the library
    loads them without an unexpected key, and the check accepts them."""
    config = _moe_config(tie_word_embeddings=True)
    folder = _saved(tmp_path, config)
    state = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, folder / "model.safetensors")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    check_weights(folder, config)


def test_pytorch_bin_is_read_on_the_meta_device(tmp_path: Path):
    """A ``pytorch_model.bin`` gives its names and shapes as torch.load does, and a shape that
    does not fit is named with the file it came from."""
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**TINY_HF_SHAPE))
    state = model.state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert read_shapes(tmp_path / "pytorch_model.bin") == {
        k: tuple(v.shape) for k, v in state.items()
    }
    wider = transformers.Qwen3Config(**{**TINY_HF_SHAPE, "intermediate_size": 40})
    with pytest.raises(ValueError, match=r"\[48, 32\] in pytorch_model.bin, \[40, 32\] from"):
        check_weights(tmp_path, wider)


def test_every_difference_is_counted_and_the_first_ones_named(tmp_path: Path):
    """Weights of a 2-block model under a config of 1 block with another vocabulary: the
    shapes that differ, then the tensors the model lacks, first three named."""
    folder = _saved(tmp_path, _moe_config())
    with pytest.raises(ValueError, match=r"do not fit its config\.json") as refused:
        check_weights(folder, _moe_config(num_hidden_layers=1, vocab_size=80))
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "2 tensor(s) of another shape (lm_head.weight: [64, 32] in model.safetensors, " in message
    )
    assert ", 21 not in the model (model.layers.1." in message and ", ...)" in message
