"""The fused C++ CPU kernel and (query, key) block shapes: every kernel equals the reference."""

from dataclasses import replace

import pytest
import torch

from liteboost.ops import rain_fusion_attention, sparse_attention
from liteboost.ops.blocks import block_shape
from liteboost.ops.cpu_extension import (
    build_config,
    build_name,
    extension_directory,
    load_cpu_kernel,
)
from liteboost.ops.fused_cpu import fused_cpu_block_sparse_attention
from liteboost.ops.rain_fusion import SparseKernel, default_kernel
from liteboost.ops.reference import reference_block_sparse_attention

# The first FlexAttention or fused-kernel call compiles (Inductor's C++ template, the kernel's
# cpp_extension build), once per vector ISA: minutes on a loaded two-core machine. The timeout
# only catches hangs, so it leaves room for that.
pytestmark = pytest.mark.timeout(900)


def _index(b, n, nq, nk, gen):
    """Random kept blocks per row (1..nk of them, no repeats), -1 padding at random positions."""
    keep = torch.randint(1, nk + 1, (b, n, nq), generator=gen)
    order = torch.rand(b, n, nq, nk, generator=gen).argsort(-1)
    index = torch.where(torch.arange(nk) < keep.unsqueeze(-1), order, -1)
    return index.gather(-1, torch.rand(index.shape, generator=gen).argsort(-1))


def _qkv(sq, sk, d=8, heads=3, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, sq, d, generator=gen)
    k, v = (torch.randn(batch, heads, sk, d, generator=gen) for _ in range(2))
    return q, k, v


def test_the_kernel_builds_here_and_is_the_cpu_default(cpu_kernel):
    """Where the extension builds, it is the one loaded and the CPU's default sparse kernel."""
    assert load_cpu_kernel() is cpu_kernel
    assert default_kernel(torch.device("cpu")) is SparseKernel.CPU


# (query block, key block), Sq, Sk: square, tall and wide blocks, partial tails on both sides,
# and a key block wider than one softmax step (300 > 256 columns).
SHAPES = [
    ((16, 16), 200, 200),
    ((32, 16), 200, 170),
    ((16, 32), 90, 200),
    ((8, 300), 40, 650),
]


@pytest.mark.parametrize(("block", "sq", "sk"), SHAPES, ids=[str(s[0]) for s in SHAPES])
@pytest.mark.parametrize("kernel", ["cpu", "gather"])
def test_kernels_match_reference_for_block_shapes(request, block, sq, sk, kernel):
    """The fused C++ kernel (needs the extension) and block gather equal the reference."""
    if kernel == "cpu":
        request.getfixturevalue("cpu_kernel")  # else "cpu" would run gather: no comparison
    q, k, v = _qkv(sq, sk)
    nq, nk = -(-sq // block[0]), -(-sk // block[1])
    index = _index(2, 3, nq, nk, torch.Generator().manual_seed(1))
    ref = reference_block_sparse_attention(q, k, v, index, block, scale=0.3)
    out = rain_fusion_attention(q, k, v, index, block_size=block, scale=0.3, kernel=kernel)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_cpu_kernel_in_bf16_and_bsnd(cpu_kernel):
    """The fused kernel on bf16 BSND inputs equals the fp32 reference to bf16 rounding."""
    q, k, v = _qkv(100, 100, d=16)
    index = _index(2, 3, 7, 7, torch.Generator().manual_seed(2))
    ref = reference_block_sparse_attention(q, k, v, index, 16)
    out = rain_fusion_attention(
        *(t.transpose(1, 2).bfloat16() for t in (q, k, v)),
        index,
        block_size=16,
        layout="BSND",
        kernel="cpu",
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.transpose(1, 2).float(), ref, atol=3e-2, rtol=3e-2)


def test_cpu_kernel_refuses_unknown_blocks_and_other_devices(cpu_kernel):
    """Zero rows and head checks are tested with the gather kernel in test_sparse_attention."""
    q, k, v = _qkv(32, 32, d=4, heads=1, batch=1)
    with pytest.raises(RuntimeError, match="key block >= 2"):
        fused_cpu_block_sparse_attention(q, k, v, torch.tensor([[[[2], [0]]]]), 16)
    meta = [t.to("meta") for t in (q, k, v)]
    with pytest.raises(ValueError, match="needs CPU tensors"):
        fused_cpu_block_sparse_attention(*meta, torch.tensor([[[[0], [1]]]]), 16)


def test_cpu_kernel_steps_aside_for_autograd():
    """No backward in C++: with autograd recording, gradients come from the gather path."""
    gen = torch.Generator().manual_seed(3)
    index = _index(1, 2, 4, 4, gen)
    grads = []
    for kernel in (fused_cpu_block_sparse_attention, reference_block_sparse_attention):
        q, k, v = (t.requires_grad_() for t in _qkv(60, 60, heads=2, batch=1))
        kernel(q, k, v, index, 16).square().sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sparse_attention_with_query_blocks_twice_the_key_blocks(qkv_factory):
    """Selection per (32-query, 16-key) block, then any kernel: all equal the reference."""
    grid = (3, 8, 9)
    q, k, v = qkv_factory(grid, batch=2)
    outs = {
        kernel: sparse_attention(
            q, k, v, latent_shape=grid, sparsity=0.5, block_size=(32, 16), kernel=kernel
        )
        for kernel in ("reference", "cpu", "gather")
    }
    for kernel in ("cpu", "gather"):
        torch.testing.assert_close(outs[kernel], outs["reference"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bad", [0, (16,), (16, 0), (16.0, 16), "16"])
def test_block_shape_names_the_bad_value(bad):
    assert block_shape(16) == (16, 16) and block_shape([32, 16]) == (32, 16)
    with pytest.raises(ValueError, match="block_size="):
        block_shape(bad)


@pytest.mark.parametrize(
    ("capability", "machine", "tag", "isa_flags"),
    [
        ("AVX512", "x86_64", "x86_avx512", {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"}),
        ("AVX2", "x86_64", "x86_avx2", {"-mavx2", "-mfma"}),  # an AVX-512 CPU capped to AVX2
        ("AVX2", "AMD64", "x86_avx2", {"-mavx2", "-mfma"}),
        ("DEFAULT", "x86_64", "x86_baseline", set()),
        ("DEFAULT", "aarch64", "aarch64", set()),
        ("SVE256", "arm64", "aarch64", set()),
        ("AVX2", "riscv64", "riscv64_portable", set()),  # a capability from the wrong arch
        ("ZVECTOR", "s390x", "s390x_portable", set()),
    ],
)
def test_build_flags_follow_the_capability_torch_dispatches(capability, machine, tag, isa_flags):
    """Injected (capability, machine): x86 flags only on x86, never above torch's own level."""
    config = build_config(capability, machine)
    assert config.tag == tag
    machine_flags = {f for f in config.cflags if f.startswith("-m")}
    assert machine_flags >= isa_flags
    if tag != "x86_avx512":
        assert not any(f.startswith("-mavx512") for f in config.cflags)
    if not tag.startswith("x86_avx"):
        assert machine_flags == set()  # portable: no x86 (or any) ISA flags
    assert {"-O3", "-ffast-math"} <= set(config.cflags)


def test_build_name_changes_with_whatever_changes_the_binary():
    avx2, avx512 = build_config("AVX2", "x86_64"), build_config("AVX512", "x86_64")
    base = build_name(avx2, "source", "2.9.0")
    assert base == build_name(avx2, "source", "2.9.0")
    assert base.startswith("liteboost_block_sparse_x86_avx2_")
    others = {
        build_name(avx512, "source", "2.9.0"),
        build_name(avx2, "source changed", "2.9.0"),
        build_name(avx2, "source", "2.10.0"),
        build_name(replace(avx2, cflags=(*avx2.cflags, "-DX")), "source", "2.9.0"),
    }
    assert base not in others and len(others) == 4


def test_each_torch_installation_builds_in_its_own_folder(monkeypatch, tmp_path):
    """Two environments with the same torch version share the name but not the build folder:
    the build command names each one's torch headers, so sharing would rebuild in turn."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "liteboost_block_sparse_x86_avx2_0123456789ab"
    one = extension_directory(name, "/envs/a/site-packages/torch")
    assert one == extension_directory(name, "/envs/a/site-packages/torch")
    assert one != extension_directory(name, "/envs/b/site-packages/torch")
    assert one.parent.parent.parent == tmp_path / "liteboost" and one.parent.name == name
    assert one.name.startswith("torch-")
    assert extension_directory(name).parent == one.parent  # the imported torch's folder
