"""Cached RoPE equals diffusers' WanRotaryPosEmbed + WanAttnProcessor rotation."""

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from liteboost.ops.rope import apply_rope, rope_tables


def _diffusers_rotate(x, freqs_cos, freqs_sin):
    # The exact arithmetic of diffusers' WanAttnProcessor.apply_rotary_emb.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


@pytest.mark.parametrize(("head_dim", "grid"), [(12, (3, 4, 4)), (128, (5, 30, 52))])
def test_rope_matches_diffusers_fp32_within_1e6(head_dim, grid):
    """Same tables and rotated values as diffusers, to 1e-6, at tiny and 480p sizes."""
    rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=1024)
    frames, height, width = grid
    cos, sin = rope(torch.zeros(1, 1, frames, 2 * height, 2 * width))
    tables = rope_tables(head_dim, grid)
    torch.testing.assert_close(tables[0], cos.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(tables[1], sin.float(), atol=1e-6, rtol=0)
    x = torch.randn(2, frames * height * width, 2, head_dim)
    expect = _diffusers_rotate(x, cos, sin)
    got = apply_rope(x, tables.pair_cos, tables.pair_sin)
    assert (got - expect).abs().max().item() < 1e-6 * max(1.0, x.abs().max().item())


def test_rope_bf16_matches_diffusers_rounding():
    """In bf16 both compute in higher precision and round once: results agree to bf16 rounding."""
    rope = WanRotaryPosEmbed(12, (1, 2, 2), max_seq_len=32)
    cos, sin = rope(torch.zeros(1, 1, 3, 8, 8))
    x = torch.randn(1, 48, 2, 12).bfloat16()
    expect = _diffusers_rotate(x, cos, sin)
    tables = rope_tables(12, (3, 4, 4))
    got = apply_rope(x, tables.pair_cos, tables.pair_sin)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)
    assert (got != expect).float().mean() < 0.02


def test_tables_are_cached_per_grid_dtype_and_device():
    a = rope_tables(12, (3, 4, 4))
    assert rope_tables(12, (3, 4, 4)) is a
    assert rope_tables(12, (3, 4, 5)) is not a
    assert rope_tables(12, (3, 4, 4), dtype=torch.float64) is not a


def test_odd_head_dim_is_refused():
    with pytest.raises(ValueError, match="head_dim=13"):
        rope_tables(13, (1, 2, 2))


@pytest.mark.timeout(900)  # dynamo tracing on a loaded two-core machine; catches hangs only
def test_boosted_transformer_compiles_without_graph_breaks_like_stock(wan_inputs, explained):
    """Cached real-fp32 RoPE and the dense chain trace into one graph, as the stock model does;
    the fullgraph compile (AOT autograd, eager kernels) equals the eager boosted output."""
    import liteboost
    from liteboost.tiny import build_tiny_transformer

    model = build_tiny_transformer()
    inputs = wan_inputs(batch=2)

    def graph_breaks():
        traced = explained(model, inputs)
        return traced.graph_count, traced.graph_break_count

    stock_graphs = graph_breaks()
    assert stock_graphs == (1, 0), "the stock tiny Wan is expected to trace as one graph"
    with liteboost.BoostManager(model, sparsity=0.0, rope_cache=True):
        with torch.no_grad():
            eager = model(**inputs).sample  # fills the table cache, as a first step would
        assert graph_breaks() == stock_graphs
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            out = compiled(**inputs).sample
        torch._dynamo.reset()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


def test_rotation_uses_no_complex_tensors():
    """The rotation is real arithmetic: no complex tensor appears (NPUs and Inductor need that)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.is_complex():
                    seen.append(func)
            return out

    tables = rope_tables(12, (3, 4, 4))
    x = torch.randn(1, 48, 2, 12)
    with Watch():
        apply_rope(x, tables.pair_cos, tables.pair_sin)
    assert seen == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_loop_equals_torch_form_which_runs_under_autograd(dtype, cpu_kernel):
    """The eager CPU rotation is the C++ loop (needs the extension); under autograd the
    functional torch form runs (the loop has no backward, and the in-place form's out= writes
    refuse autograd). Both compute in fp32 and round once: equal to float rounding."""
    from liteboost.ops.rope import _cpu_kernel

    tables = rope_tables(12, (3, 4, 4))
    x = torch.randn(2, 48, 2, 12, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert _cpu_kernel(x, tables.pair_cos, tables.pair_sin) is cpu_kernel, "the loop must run"
    fast = apply_rope(x, tables.pair_cos, tables.pair_sin)
    leaf = x.float().requires_grad_()
    graded = leaf.to(dtype)
    slow = apply_rope(graded, tables.pair_cos, tables.pair_sin)
    assert slow.requires_grad and fast.dtype == slow.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fast, slow.detach(), atol=tolerance, rtol=tolerance)
    if dtype == torch.bfloat16:  # one rounding each: bf16 values rarely differ at all
        assert (fast != slow.detach()).float().mean() < 0.02
    slow.float().sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    # Tables of another shape than [S, 1, D/2] (here broadcast over tokens) take the torch form.
    assert _cpu_kernel(x, tables.pair_cos[:1], tables.pair_sin[:1]) is None
