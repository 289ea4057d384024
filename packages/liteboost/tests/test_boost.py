"""BoostManager on the tiny Wan: equal to stock at sparsity 0, undone by remove(), clear errors."""

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

import liteboost
from liteboost.tiny import build_tiny_transformer

# The first FlexAttention or fused-kernel call compiles (Inductor's C++ template, the kernel's
# cpp_extension build), once per vector ISA: minutes on a loaded two-core machine. The timeout
# only catches hangs, so it leaves room for that.
pytestmark = pytest.mark.timeout(900)


@torch.no_grad()
def _run(model, inputs):
    return model(**inputs).sample


def test_boost_at_sparsity_zero_equals_stock_model(wan_inputs):
    model = build_tiny_transformer()
    inputs = wan_inputs(batch=2)
    stock = _run(model, inputs)
    with liteboost.BoostManager(model, sparsity=0.0) as manager:
        assert manager.boosted == ["model"]
        boosted = _run(model, inputs)
    torch.testing.assert_close(boosted, stock, atol=1e-5, rtol=1e-5)
    assert torch.equal(_run(model, inputs), stock), "remove() must restore the stock model exactly"
    assert all(isinstance(p, WanAttnProcessor) for p in model.attn_processors.values())


@pytest.mark.parametrize("variant", ["i2v", "ti2v"])
def test_boost_on_i2v_and_ti2v_models(variant, wan_variant_inputs, tiny_i2v):
    """Wan2.1 I2V (image K/V branch) and Wan2.2 TI2V (per-token timestep): dense boost equals
    stock; sparse boost with the gather kernel equals the reference kernel."""
    model = build_tiny_transformer(**(tiny_i2v if variant == "i2v" else {}))
    inputs = wan_variant_inputs(variant, grid=(3, 8, 9))
    stock = _run(model, inputs)
    with liteboost.BoostManager(model):
        torch.testing.assert_close(_run(model, inputs), stock, atol=1e-5, rtol=1e-5)
    with liteboost.BoostManager(model, sparsity=0.5, block_size=16, sparse_kernel="reference"):
        ref = _run(model, inputs)
    with liteboost.BoostManager(model, sparsity=0.5, block_size=16, sparse_kernel="gather"):
        gather = _run(model, inputs)
    torch.testing.assert_close(gather, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, stock, atol=1e-6), "sparsity 0.5 must skip some blocks"


def test_sparse_boost_uses_the_plan_of_the_op(wan_inputs):
    """Sparse self-attention inside the model: gather, flex and the reference kernel agree.

    216 tokens in blocks of 16: the last block is partial (the kernel bounds the tail itself).
    Same attention shape as test_sparse_attention.py, so the compiled kernel is shared.
    """
    model = build_tiny_transformer()
    inputs = wan_inputs(grid=(3, 8, 9), batch=2)
    with liteboost.BoostManager(model, sparsity=0.5, block_size=16, sparse_kernel="reference"):
        ref = _run(model, inputs)
    stock = _run(model, inputs)
    with liteboost.BoostManager(model, sparsity=0.5, block_size=16, sparse_kernel="flex"):
        flex = _run(model, inputs)
    with liteboost.BoostManager(model, sparsity=0.5, block_size=16):  # CPU default: gather
        gather = _run(model, inputs)
    torch.testing.assert_close(flex, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gather, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, stock, atol=1e-6), "sparsity 0.5 must skip some blocks"


def test_boost_a_pipeline_boosts_its_transformer(wan_inputs):
    """Boosting a pipeline swaps its transformer's attention processors for liteboost's (sparse
    output differs from stock, dense equals it) and remove() restores the stock processors."""
    from liteboost.attention.processor import BoostedWanAttnProcessor
    from liteboost.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline()
    model = pipe.transformer
    inputs = wan_inputs(grid=(3, 8, 9))
    stock = _run(model, inputs)
    manager = liteboost.BoostManager(pipe, sparsity=0.5, block_size=16, sparse_kernel="reference")
    assert manager.boosted == ["transformer"]
    processors = model.attn_processors.values()
    assert processors and all(isinstance(p, BoostedWanAttnProcessor) for p in processors)
    sparse = _run(model, inputs)
    manager.remove()
    assert not torch.allclose(sparse, stock, atol=1e-6), "sparsity 0.5 must change the output"
    assert all(isinstance(p, WanAttnProcessor) for p in model.attn_processors.values())
    assert torch.equal(_run(model, inputs), stock), "remove() must restore the stock transformer"
    with liteboost.BoostManager(pipe, sparsity=0.0):
        torch.testing.assert_close(_run(model, inputs), stock, atol=1e-5, rtol=1e-5)


def test_unsupported_model_lists_supported_classes():
    with pytest.raises(liteboost.UnsupportedModelError, match="WanTransformer3DModel"):
        liteboost.BoostManager(torch.nn.Linear(2, 2))
    with pytest.raises(liteboost.UnsupportedModelError, match="AutoencoderKLWan"):
        liteboost.ParallelManager(torch.nn.Linear(2, 2))


@pytest.fixture
def toy_model_class():
    """A model class registered for the test only: the registry is restored afterwards."""
    from liteboost.models.registry import unregister_boost

    class ToyModel(torch.nn.Module):
        pass

    yield ToyModel
    unregister_boost("ToyModel")
    assert "ToyModel" not in liteboost.supported_boosts()


def test_register_boost_extends_the_registry(toy_model_class):
    calls = []

    @liteboost.register_boost("ToyModel")
    def _boost(model, config):
        calls.append(config.sparsity)
        return type("Handle", (), {"remove": lambda self: calls.append("removed")})()

    manager = liteboost.BoostManager(toy_model_class(), sparsity=0.25)
    manager.remove()
    assert calls == [0.25, "removed"]
    assert "ToyModel" in liteboost.supported_boosts()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sparsity": 1.5}, r"sparsity: .*less than 1 \(got 1.5\)"),
        ({"attention_backend": "cudnn"}, "attention_backend='cudnn'.*fa3, fa2, npu, sdpa"),
        ({"sparse_kernel": "triton"}, "sparse_kernel: 'triton' is not a sparse kernel"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, match):
    """An out-of-range or unknown setting is one line naming the field, the value and the rule."""
    with pytest.raises(ValueError, match=match):
        liteboost.BoostManager(build_tiny_transformer(), **kwargs)
