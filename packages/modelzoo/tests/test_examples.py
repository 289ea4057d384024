"""The examples and the exported artefacts against independent references."""

import pytest
import torch
from typer.testing import CliRunner

from torchmind_modelzoo import registry
from torchmind_modelzoo.build import build_model
from torchmind_modelzoo.cli import app
from torchmind_modelzoo.examples.base import example_for
from torchmind_modelzoo.examples.embed import pool
from torchmind_modelzoo.examples.speech import synthetic_waveform


def test_greedy_generation_matches_recomputed_argmax():
    """KV-cache decoding picks the same tokens as re-running the whole sequence each step."""
    card = registry.get("qwen3-0.6b")
    model = build_model(card, tiny=True)
    example = example_for(card)
    ids = example.inputs(model)["input_ids"]
    tokens = example.generate(model, ids, 5)
    seq = ids
    with torch.no_grad():
        for _ in range(5):
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert tokens == seq[0, ids.shape[1] :].tolist()


def test_multimodal_generation_matches_recomputed_argmax():
    """Qwen3-VL: decoding through the cache (M-RoPE deltas kept from the prefill) picks the same
    tokens as re-running image + text + generated tokens from scratch."""
    card = registry.get("qwen3-vl-2b-instruct")
    model = build_model(card, tiny=True)
    example = example_for(card)
    inputs = example.inputs(model)
    tokens = example.generate(model, inputs, 3)
    ids = inputs["input_ids"]
    with torch.no_grad():
        for _ in range(3):
            full = inputs | {"input_ids": ids, "mm_token_type_ids": (ids == 120).int()}
            nxt = model(**full, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert tokens == ids[0, inputs["input_ids"].shape[1] :].tolist()


def test_saved_program_reloads_and_accepts_other_lengths(tmp_path):
    """The .pt2 written by convert loads with torch.export.load and runs a new sequence length."""
    card = registry.get("qwen3-8b")
    runner = CliRunner()
    out = runner.invoke(app, ["convert", card.id, "--tiny", "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    program = torch.export.load(tmp_path / "model.pt2")
    model = build_model(card, tiny=True)  # same seed -> same weights as the converted model
    ids = torch.randint(0, 128, (1, 13))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    got = program.module(check_guards=False)(input_ids=ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_pooling_matches_manual_reference():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    torch.testing.assert_close(pool(hidden, mask, "cls"), hidden[:, 0])
    torch.testing.assert_close(
        pool(hidden, mask, "last"), torch.stack([hidden[0, 3], hidden[1, 1]])
    )
    torch.testing.assert_close(
        pool(hidden, mask, "mean"), torch.stack([hidden[0].mean(0), hidden[1, :2].mean(0)])
    )


def test_embedding_ignores_padding_tokens():
    """Changing padded token ids leaves a mean-pooled embedding unchanged."""
    card = registry.get("embeddinggemma-300m")
    model = build_model(card, tiny=True)
    example = example_for(card)
    inputs = example.inputs(model)
    ids = inputs["input_ids"].clone()
    ids[1, inputs["attention_mask"][1] == 0] = 5
    with torch.no_grad():
        a = example.forward(model, **inputs)
        b = example.forward(model, **(inputs | {"input_ids": ids}))
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)


def test_synthetic_waveform_is_bounded_and_deterministic():
    wave = synthetic_waveform(0.5)
    assert wave.shape == (8000,) and wave.dtype == torch.float32
    assert 0.05 < float(wave.abs().max()) <= 0.3 + 1e-6
    torch.testing.assert_close(wave, synthetic_waveform(0.5))


def test_cli_run_prints_json_result():
    out = CliRunner().invoke(app, ["run", "bge-reranker-v2-m3", "--tiny"])
    assert out.exit_code == 0, out.output
    assert '"task": "rerank-cross-encoder"' in out.output


def test_run_without_tiny_needs_a_local_path():
    card = registry.get("qwen3-0.6b")
    with pytest.raises(FileNotFoundError, match="modelzoo never fetches weights"):
        build_model(card, tiny=False, path=None)


def test_listed_card_cannot_be_converted(tmp_path):
    from torchmind_modelzoo.convert import convert

    with pytest.raises(ValueError, match="listed card"):
        convert(registry.get("minicpm-v-4.5"), tmp_path, tiny=True)
