"""Attention pass: transformers-style eager attention (matmul, scale, additive mask, fp32 softmax,
matmul, grouped K/V) becomes one CPU flash-attention call where flash is measured faster (fake
timers) or, with measuring off, where ``MIN_KEYS`` allows; near misses are refused; results match
eager and a float64 reference."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from npu_core.timing import use_timer

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
B, HEADS, KV_HEADS, DIM = 1, 4, 2, 16


@pytest.fixture(autouse=True)
def _decisions(monkeypatch, tmp_path):
    """The ``MIN_KEYS`` fallback decides unless a test measures (a fresh cache per test)."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "fallback")
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' ``repeat_kv``: grouped K/V heads expanded to the query heads."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention(q, k, v, mask, *, scale=0.25, divide=False, probs_too=False, dim=-1):
    """transformers' ``eager_attention_forward`` (Llama family), dropout off."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(2, 3))
    scores = scores / (1 / scale) if divide else scores * scale
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=dim, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, v)
    return (out, weights) if probs_too else out


def causal_mask(length: int, dtype: torch.dtype) -> torch.Tensor:
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(B, 1, length, length).masked_fill(blocked, torch.finfo(dtype).min).to(dtype)


def inputs(length: int, dtype: torch.dtype, masked: bool = True):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, HEADS, length, DIM, generator=gen).to(dtype)
    k = torch.randn(B, KV_HEADS, length, DIM, generator=gen).to(dtype)
    v = torch.randn(B, KV_HEADS, length, DIM, generator=gen).to(dtype)
    return q, k, v, causal_mask(length, dtype) if masked else None


def trace(fn, q, k, v, mask):
    """``fn(q, k, v, mask)`` (the mask a graph input, as in a compiled model) traced with
    Inductor's decompositions, so softmax is amax/sub/exp/sum/div and matmul is
    expand/reshape/bmm, as in Inductor's post-grad graph."""
    args = (q, k, v) if mask is None else (q, k, v, mask)

    def call(q, k, v, *rest):
        return fn(q, k, v, rest[0] if rest else None)

    return make_fx(call, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def run(gm, q, k, v, mask):
    return gm(q, k, v) if mask is None else gm(q, k, v, mask)


def reference(q, k, v, mask):
    """float64 SDPA from stock PyTorch (independent of the traced eager form)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep).double(), repeat_kv(v, n_rep).double()
    m = mask.double() if mask is not None else None
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k, v, attn_mask=m, scale=0.25
    )


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "unmasked"])
@pytest.mark.parametrize("divide", [False, True], ids=["mul-scale", "div-scale"])
def test_eager_attention_becomes_flash(harness, masked, divide):
    q, k, v, mask = inputs(512, torch.float32, masked)
    fn = functools.partial(eager_attention, divide=divide)
    gm = trace(fn, q, k, v, mask)
    assert harness.count(gm, aten.bmm.default) == 2 and harness.count(gm, FLASH) == 0
    record = harness.apply(gm, "attention")
    assert record.rewritten("attention") == 1, record.summary()
    assert harness.count(gm, aten.bmm.default) == 0 and harness.count(gm, FLASH) == 1
    assert harness.count(gm, aten.amax.default) == 0 and harness.count(gm, aten.exp.default) == 0
    out = run(gm, q, k, v, mask)
    torch.testing.assert_close(out, fn(q, k, v, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_bf16_round_trip_is_matched_and_refused_as_unmeasured(harness):
    """The bf16 form (fp32 softmax cast back) is recognised, but bf16 is not in MIN_KEYS."""
    q, k, v, mask = inputs(512, torch.bfloat16)
    gm = trace(eager_attention, q, k, v, mask)
    record = harness.apply(gm, "attention")
    assert record.rewritten() == 0
    assert any("flash not faster here" in d.reason for d in record.refused("attention"))
    assert harness.count(gm, aten.bmm.default) == 2


def test_bf16_rewrite_is_accurate_where_allowed(harness, monkeypatch):
    """With bf16 admitted, the rewrite stays within bf16 rounding of the float64 reference, no
    further than eager bf16 itself (flash keeps the scores in fp32)."""
    from mfusion.passes import attention

    monkeypatch.setitem(attention.MIN_KEYS, torch.bfloat16, 1)
    q, k, v, mask = inputs(256, torch.bfloat16)
    gm = trace(eager_attention, q, k, v, mask)
    assert harness.apply(gm, "attention").rewritten("attention") == 1
    ref = reference(q, k, v, mask)
    err = (run(gm, q, k, v, mask).double() - ref).abs().max().item()
    eager_err = (eager_attention(q, k, v, mask).double() - ref).abs().max().item()
    assert err <= max(eager_err, 1e-2), (err, eager_err)


@pytest.mark.parametrize(
    ("length", "kwargs", "reason"),
    [
        (128, {}, "flash not faster here"),
        (512, {"probs_too": True}, "used elsewhere"),
    ],
    ids=["short-keys", "probabilities-returned"],
)
def test_refusals(harness, length, kwargs, reason):
    q, k, v, mask = inputs(length, torch.float32)
    fn = functools.partial(eager_attention, **kwargs)
    gm = trace(fn, q, k, v, mask)
    record = harness.apply(gm, "attention")
    assert record.rewritten() == 0
    assert any(reason in d.reason for d in record.refused("attention")), record.summary()
    assert harness.count(gm, FLASH) == 0
    torch.testing.assert_close(run(gm, q, k, v, mask), fn(q, k, v, mask))


def test_softmax_over_queries_is_not_attention(harness):
    """softmax over dim -2 (not the keys) is left alone without a refusal."""
    q, k, v, mask = inputs(512, torch.float32)
    fn = functools.partial(eager_attention, dim=-2)
    gm = trace(fn, q, k, v, mask)
    record = harness.apply(gm, "attention")
    assert record.rewritten() == 0 and not record.refused("attention")
    torch.testing.assert_close(run(gm, q, k, v, mask), fn(q, k, v, mask))


def test_mask_over_heads_and_batch_is_passed_through(harness):
    """A full [B, H, L, S] mask (e.g. padding per head) is kept as the flash call's mask."""
    q, k, v, _ = inputs(512, torch.float32)
    mask = torch.randn(B, HEADS, 512, 512)
    gm = trace(eager_attention, q, k, v, mask)
    assert harness.apply(gm, "attention").rewritten("attention") == 1
    torch.testing.assert_close(
        run(gm, q, k, v, mask).double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5
    )


@pytest.mark.slow
def test_compiled_eager_attention_runs_flash_and_matches_eager():
    """Through torch.compile: Inductor's own SDPA patterns leave this form alone (the pass
    finds it in the real post-grad graph) and the compiled result equals eager."""
    import mfusion

    q, k, v, mask = inputs(512, torch.float32)
    torch._dynamo.reset()
    with (
        mfusion.enabled(backend="inductor", passes=["attention"], auto_fuse=False),
        torch.no_grad(),
    ):
        out = torch.compile(eager_attention)(q, k, v, mask)
    report = mfusion.report()
    assert sum(graph.rewritten("attention") for graph in report) == 1, str(report)
    torch.testing.assert_close(out, eager_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


def _flash_node(gm):
    (node,) = [n for n in gm.graph.nodes if n.target is FLASH]
    return node


def test_repeated_kv_heads_go_to_the_kernel_ungrouped(harness):
    """transformers' repeat_kv (unsqueeze, expand, copy, reshape) is dropped: the kernel reads
    the 2 K/V heads for 4 query heads itself, and the result is the repeated one's."""
    q, k, v, mask = inputs(512, torch.float32)
    gm = trace(eager_attention, q, k, v, mask)
    assert harness.count(gm, aten.clone.default) == 2  # the two repeat copies
    record = harness.apply(gm, "attention")
    assert record.rewritten("attention") == 1
    assert "GQA 2 K/V heads" in record.decisions[0].reason
    flash = _flash_node(gm)
    for operand in flash.args[1:3]:
        assert tuple(operand.meta["val"].shape) == (B, KV_HEADS, 512, DIM)
    assert harness.count(gm, aten.clone.default) == 0
    out = run(gm, q, k, v, mask)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


def tile_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Heads tiled ``h0 h1 h0 h1`` (not ``repeat_kv``'s ``h0 h0 h1 h1``): another grouping."""
    b, h, s, d = x.shape
    return x[:, None].expand(b, n_rep, h, s, d).reshape(b, h * n_rep, s, d)


def test_other_head_groupings_keep_their_repeated_kv(harness):
    """K/V repeated in another order, or not grouped at all, go to the kernel as they are: the
    kernel's grouping (query head h reads K/V head h // n_rep) would be wrong for them."""
    q, k, v, mask = inputs(512, torch.float32)

    def tiled(q, k, v, mask):
        scores = torch.matmul(q, tile_kv(k, 2).transpose(2, 3)) * 0.25 + mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, tile_kv(v, 2))

    gm = trace(tiled, q, k, v, mask)
    record = harness.apply(gm, "attention")
    assert record.rewritten("attention") == 1 and "GQA" not in record.decisions[0].reason
    assert tuple(_flash_node(gm).args[1].meta["val"].shape) == (B, HEADS, 512, DIM)
    torch.testing.assert_close(run(gm, q, k, v, mask), tiled(q, k, v, mask), atol=1e-5, rtol=1e-5)

    full_heads = inputs(512, torch.float32)[0]  # K/V with as many heads as Q
    gm = trace(eager_attention, q, full_heads, full_heads, mask)
    record = harness.apply(gm, "attention")
    assert record.rewritten("attention") == 1 and "GQA" not in record.decisions[0].reason


def test_grouped_kv_stays_repeated_where_the_kernel_lacks_gqa(harness, monkeypatch):
    from mfusion.passes import attention

    assert attention.flash_takes_gqa()  # this torch's kernel: the probe's positive case
    monkeypatch.setattr(attention, "flash_takes_gqa", lambda: False)
    q, k, v, mask = inputs(512, torch.float32)
    gm = trace(eager_attention, q, k, v, mask)
    assert harness.apply(gm, "attention").rewritten("attention") == 1
    assert tuple(_flash_node(gm).args[1].meta["val"].shape) == (B, HEADS, 512, DIM)
    torch.testing.assert_close(
        run(gm, q, k, v, mask).double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5
    )


def built_mask(length: int, keys: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask computed from ``arange`` inside the traced function (as transformers
    builds it: no graph input), expanded over the batch."""
    i = torch.arange(length)[:, None] + (keys - length)  # bottom-right aligned, like HF
    j = torch.arange(keys)[None, :]
    allowed = j <= i
    if kind == "sliding":
        allowed = allowed & (j > i - 64)
    blocked = -10_000.0 if kind == "small-blocked" else torch.finfo(dtype).min
    mask = torch.zeros(length, keys, dtype=dtype).masked_fill(~allowed, blocked)
    return mask[None, None].expand(B, 1, length, keys)


def masked_attention(kind: str, length: int):
    def fn(q, k, v, mask):
        return eager_attention(q, k, v, built_mask(length, k.shape[2], kind, q.dtype))

    return fn


def test_causal_mask_built_in_the_graph_becomes_is_causal(harness):
    """The arange-built causal mask is proven causal at compile time: the kernel gets
    is_causal=True and no mask (the mask's nodes go away), same result."""
    q, k, v, _ = inputs(512, torch.float32)
    fn = masked_attention("causal", 512)
    gm = trace(fn, q, k, v, None)
    assert harness.count(gm, torch.ops.prims.iota.default) == 2
    record = harness.apply(gm, "attention")
    assert record.rewritten("attention") == 1
    assert "causal, GQA" in record.decisions[0].reason
    flash = _flash_node(gm)
    assert flash.args[4] is True and "attn_mask" not in flash.kwargs
    assert harness.count(gm, torch.ops.prims.iota.default) == 0
    out = run(gm, q, k, v, None)
    mask = built_mask(512, 512, "causal", torch.float32)
    torch.testing.assert_close(out, fn(q, k, v, None), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kind", "length"),
    [("sliding", 512), ("small-blocked", 512), ("causal", 256)],
    ids=["sliding-window", "blocked-by-minus-1e4", "fewer-queries-than-keys"],
)
def test_masks_not_proven_causal_are_passed_as_masks(harness, kind, length):
    """A sliding window, a mask whose blocked value is not far enough below the scores, and a
    causal mask with L != S (the kernel aligns is_causal top-left) keep the mask."""
    q = inputs(length, torch.float32)[0]
    _, k, v, _ = inputs(512, torch.float32)
    fn = masked_attention(kind, length)
    gm = trace(fn, q, k, v, None)
    record = harness.apply(gm, "attention")
    assert record.rewritten("attention") == 1
    assert record.decisions[0].reason.startswith("flash attention (masked, GQA")
    flash = _flash_node(gm)
    assert flash.args[4] is False and "attn_mask" in flash.kwargs
    mask = built_mask(length, 512, kind, torch.float32)
    torch.testing.assert_close(
        run(gm, q, k, v, None).double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5
    )


def test_mask_from_a_graph_input_is_never_assumed_causal(harness):
    """The same causal values arriving as an input can change between calls: kept as a mask."""
    q, k, v, mask = inputs(512, torch.float32)
    gm = trace(eager_attention, q, k, v, mask)
    harness.apply(gm, "attention")
    flash = _flash_node(gm)
    assert flash.args[4] is False and "attn_mask" in flash.kwargs


def _slow_timer(flash_s: float):
    """Flash at ``flash_s`` per call against 1.0 for Inductor's form, after checking both forms
    compute the same attention."""

    def timer(calls):
        flash, unfused = (call() for call in calls.values())
        torch.testing.assert_close(flash[0], unfused, atol=2e-2, rtol=2e-2)
        timer.calls += 1
        return dict(zip(calls, (flash_s, 1.0), strict=True))

    timer.calls = 0
    return timer


@pytest.mark.parametrize(("length", "flash_s", "rewritten"), [(128, 0.5, 1), (512, 0.99, 0)])
def test_measured_decision_overrules_min_keys(
    harness, monkeypatch, tmp_path, length, flash_s, rewritten
):
    """Measuring on: flash is used where it is timed clearly faster here, also below MIN_KEYS,
    and refused where it is not, also above; the answer is cached per shape and machine."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "measure")
    q, k, v, mask = inputs(length, torch.float32)
    timer = _slow_timer(flash_s)
    with use_timer(timer):
        record = harness.apply(trace(eager_attention, q, k, v, mask), "attention")
    assert record.rewritten("attention") == rewritten and timer.calls == 1, record.summary()
    if not rewritten:
        assert "flash not faster here" in record.refused("attention")[0].reason
    assert len(list((tmp_path / "attention").glob("*.json"))) == 1
    with use_timer(harness.failing_timer):
        gm = trace(eager_attention, q, k, v, mask)
        assert harness.apply(gm, "attention").rewritten("attention") == rewritten
    torch.testing.assert_close(run(gm, q, k, v, mask), eager_attention(q, k, v, mask))


def test_measured_bf16_flash_is_used_where_faster(harness, monkeypatch):
    """bf16 has no MIN_KEYS entry (flash was slower on one CPU), but a machine where it is timed
    faster gets it."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "measure")
    q, k, v, mask = inputs(256, torch.bfloat16)
    with use_timer(_slow_timer(0.5)):
        record = harness.apply(trace(eager_attention, q, k, v, mask), "attention")
    assert (
        record.rewritten("attention") == 1
        and "(ratio 0.50, measured)" in record.decisions[0].reason
    )
