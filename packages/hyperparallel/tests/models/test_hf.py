"""transformers causal LMs wrapped for the trainer, against the library's own forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from hyperparallel.models.hf import CausalLM, build_causal_lm
from packages.hyperparallel.tests.tiny_hf import QWEN3_MOE

MOE = QWEN3_MOE


def _model(shape: dict, config_cls: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**shape, **extra)
    return transformers.AutoModelForCausalLM.from_config(config)


def _batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(64, (2, 12), generator=gen)
    return tokens, torch.randint(64, (2, 12), generator=gen)


@pytest.mark.parametrize(("config_cls", "extra"), [("Qwen3Config", {}), ("Qwen3MoeConfig", MOE)])
def test_loss_and_gradients_equal_the_library_forward(
    config_cls: str, extra: dict, tiny_hf_shape: dict
):
    model = _model(tiny_hf_shape, config_cls, **extra)
    tokens, targets = _batch()
    moe = bool(extra)
    out = model(input_ids=tokens, output_router_logits=moe) if moe else model(input_ids=tokens)
    ref_ce = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    ref_aux = out.aux_loss if moe else torch.zeros(())
    params = [p for p in model.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(ref_ce + 0.01 * ref_aux, params, allow_unused=True)

    wrapped = CausalLM(model, chunk_rows=5)
    ce, aux = wrapped(tokens, targets)
    grads = torch.autograd.grad(ce + 0.01 * aux, params, allow_unused=True)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-6)
    assert (aux.item() > 0) == moe
    for got, want in zip(grads, ref_grads, strict=True):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_names_stay_the_librarys_and_blocks_are_not_duplicated(tiny_hf_shape: dict):
    model = _model(tiny_hf_shape, "Qwen3Config")
    wrapped = CausalLM(model)
    assert len(wrapped.layers) == 2 and wrapped.layers[0] is model.model.layers[0]
    names = set(wrapped.state_dict())
    assert names == {f"model.{n}" for n in model.state_dict()}


def test_sequence_longer_than_the_config_is_refused(tiny_hf_shape: dict):
    wrapped = CausalLM(_model({**tiny_hf_shape, "max_position_embeddings": 32}, "Qwen3Config"))
    long = torch.zeros(1, 33, dtype=torch.long)
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_position_embeddings=32"):
        wrapped(long, long)


def test_build_from_folder_config_and_weights(tmp_path: Path, tiny_hf_shape: dict):
    model = _model(tiny_hf_shape, "Qwen3Config")
    model.save_pretrained(tmp_path)
    tokens, targets = _batch()
    want, _ = CausalLM(model)(tokens, targets)

    loaded = build_causal_lm(tmp_path, load_weights=True)
    got, _ = loaded(tokens, targets)
    torch.testing.assert_close(got, want)

    tiny = build_causal_lm(tmp_path / "config.json", overrides={"num_hidden_layers": 1}, seed=3)
    again = build_causal_lm(tmp_path, overrides={"num_hidden_layers": 1}, seed=3)
    assert len(tiny.layers) == 1
    for a, b in zip(tiny.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)  # same seed, same weights: every rank builds the same model


def test_build_errors_name_the_problem(tmp_path: Path, tiny_hf_shape: dict):
    with pytest.raises(FileNotFoundError, match=r"no config\.json there"):
        build_causal_lm(tmp_path)
    with pytest.raises(FileNotFoundError, match="needs a model folder"):
        build_causal_lm(transformers.Qwen3Config(**tiny_hf_shape), load_weights=True)
