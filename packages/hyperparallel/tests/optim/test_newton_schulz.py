"""Newton-Schulz kernels: torch parity, orthogonality, presets, batching, memory cap, strategy."""

from __future__ import annotations

import json

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from hyperparallel.optim import newton_schulz as ns
from hyperparallel.optim.newton_schulz import (
    KELLER,
    Strategy,
    estimate_batch_bytes,
    newton_schulz,
    orthogonalize,
    resolve_coefficients,
)
from npu_core import decisions
from npu_core.timing import use_timer

KELLER_5 = resolve_coefficients("keller", 5)


@pytest.fixture(autouse=True)
def _fresh_decisions():
    decisions.forget()
    yield
    decisions.forget()


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape", [(16, 16), (12, 40), (40, 12), (33, 7)])
def test_newton_schulz_matches_torch_muon_on_matrices(shape):
    """2-D keller NS equals torch.optim.Muon's kernel, tall and wide."""
    g = _randn(*shape)
    expected = _zeropower_via_newtonschulz(g, KELLER, 5, 1e-7)
    got = newton_schulz(g, KELLER_5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float(), rtol=0, atol=1e-6)


def test_newton_schulz_batches_each_matrix_with_its_own_norm():
    """A [2, 3, M, N] batch equals per-matrix NS, even when one matrix is scaled up."""
    g = _randn(2, 3, 20, 12)
    g[1, 2] *= 1024  # a power of two: exact in bf16, so only the per-matrix norm can undo it
    got = newton_schulz(g, KELLER_5)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(
                got[i, j], newton_schulz(g[i, j], KELLER_5), rtol=1e-6, atol=0
            )
    torch.testing.assert_close(got[1, 2], newton_schulz(g[1, 2] / 1024, KELLER_5), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("keller", 0.6, 1.2), ("quintic", 0.9, 1.1), ("polar_express", 0.8, 1.2)],
)
@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
def test_newton_schulz_singular_values_near_one(preset, low, high, shape):
    """After 5 steps every singular value lies in the preset's band around 1."""
    out = newton_schulz(_randn(*shape, seed=3), resolve_coefficients(preset, 5))
    sv = torch.linalg.svdvals(out.double())
    assert low <= sv.min().item() and sv.max().item() <= high, sv


def test_newton_schulz_zero_matrix_stays_zero():
    """The eps clamp turns an all-zero input into zeros, not NaN."""
    out = newton_schulz(torch.zeros(4, 6), KELLER_5)
    assert torch.equal(out, torch.zeros(4, 6))


def test_newton_schulz_keeps_input_dtype_and_input():
    """bf16 in gives bf16 out, and the input is not modified in place."""
    g = _randn(8, 8, dtype=torch.bfloat16)
    before = g.clone()
    assert newton_schulz(g, KELLER_5).dtype == torch.bfloat16
    assert torch.equal(g, before)


def test_newton_schulz_rejects_vector():
    """A 1-D tensor is refused with its shape in the message."""
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        newton_schulz(torch.ones(5), KELLER_5)


def _compose(schedule, sigma: torch.Tensor) -> torch.Tensor:
    """Singular values after the scalar iteration sigma <- a sigma + b sigma^3 + c sigma^5."""
    for a, b, c in schedule:
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


def test_resolve_coefficients_presets():
    """Keller and quintic repeat one step; a tuple is used as given."""
    assert resolve_coefficients("keller", 3) == [KELLER] * 3
    assert resolve_coefficients("quintic", 2) == [(3.0, -3.2, 1.2)] * 2
    assert resolve_coefficients((1, -1.0, 0.5), 2) == [(1.0, -1.0, 0.5)] * 2


def test_polar_express_schedule_has_its_defining_properties():
    """Polar Express by what it must do, not by its table: 8 per-step quintics map every
    singular value in [1e-3, 1.01] (1.01: the safety margin for round-off) to 1 within 1e-6,
    and the step repeated afterwards is the quintic tangent to 1 to third order at 1."""
    schedule = resolve_coefficients("polar_express", 10)
    assert len(set(schedule[:7])) == 7, "the first steps are each their own polynomial"
    sigma = torch.logspace(-3, torch.log10(torch.tensor(1.01)).item(), 20001, dtype=torch.float64)
    after = _compose(schedule[:8], sigma)
    assert (after - 1).abs().max().item() < 1e-6
    # keller's fixed step, as a control, is nowhere near: the schedule is what converges
    assert (_compose(KELLER_5 + KELLER_5[:3], sigma) - 1).abs().max().item() > 0.1
    # p(1) = 1, p'(1) = 0, p''(1) = 0 for p(x) = a x + b x^3 + c x^5, solved here
    conditions = torch.tensor([[1, 1, 1], [1, 3, 5], [0, 6, 20]], dtype=torch.float64)
    tangent = torch.linalg.solve(conditions, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    for step in schedule[7:]:
        torch.testing.assert_close(torch.tensor(step, dtype=torch.float64), tangent)


@pytest.mark.parametrize(
    ("spec", "steps", "match"),
    [
        ("nope", 5, r"ns_coefficients='nope' is not a known preset.*'polar_express'"),
        ((1.0, 2.0), 5, r"three finite numbers"),
        ((1.0, float("nan"), 2.0), 5, r"three finite numbers"),
        ("keller", 0, r"ns_steps=0 is invalid"),
    ],
)
def test_resolve_coefficients_errors(spec, steps, match):
    """Unknown names, malformed tuples and bad step counts are named in the error."""
    with pytest.raises(ValueError, match=match):
        resolve_coefficients(spec, steps)


def _mixed_matrices() -> list[torch.Tensor]:
    return [
        _randn(24, 24, seed=1),
        _randn(10, 30, seed=2),
        _randn(4, 10, 6, seed=3),
        _randn(24, 24, seed=4),
        _randn(10, 30, seed=5),
        _randn(24, 24, seed=6, dtype=torch.bfloat16),
    ]


NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# bmm and mm may sum in different orders: fp32 results differ in the last bits, bf16 results
# round both to the same bf16 numbers.
AGREEMENT = {"bf16": {"rtol": 1e-6, "atol": 0}, "fp32": {"rtol": 0, "atol": 1e-5}}


@pytest.mark.parametrize("ns_dtype", NS_DTYPES)
def test_orthogonalize_batched_equals_loop_and_per_matrix(ns_dtype):
    """Both strategies give per-matrix NS in the chosen dtype, in input order, shape and dtype."""
    matrices = _mixed_matrices()
    batched = orthogonalize(matrices, KELLER_5, strategy="batched", ns_dtype=ns_dtype)
    loop = orthogonalize(matrices, KELLER_5, strategy="loop", ns_dtype=ns_dtype)
    for m, b, lp in zip(matrices, batched, loop, strict=True):
        assert b.shape == m.shape and b.dtype == m.dtype
        torch.testing.assert_close(b, lp, **AGREEMENT[ns_dtype])
        expected = newton_schulz(m, KELLER_5, dtype=NS_DTYPES[ns_dtype])
        torch.testing.assert_close(b, expected, **AGREEMENT[ns_dtype])


def test_orthogonalize_experts_equal_per_expert_ns():
    """[E, M, N] is E independent matrices."""
    experts = _randn(5, 12, 8, seed=7)
    (out,) = orthogonalize([experts], KELLER_5, strategy="batched", ns_dtype="bf16")
    for e in range(5):
        torch.testing.assert_close(out[e], newton_schulz(experts[e], KELLER_5), rtol=1e-6, atol=0)


def test_fp32_newton_schulz_tracks_fp64_and_bf16_tracks_it_loosely():
    """fp32 is the same iteration as an fp64 run to ~1e-5; bf16 agrees to bf16 precision."""
    g = _randn(2, 24, 40, seed=11)
    exact = newton_schulz(g.double(), KELLER_5, dtype=torch.float64)
    fp32 = newton_schulz(g, KELLER_5, dtype=torch.float32)
    bf16 = newton_schulz(g, KELLER_5, dtype=torch.bfloat16)
    torch.testing.assert_close(fp32.double(), exact, rtol=0, atol=1e-5)
    torch.testing.assert_close(bf16.double(), exact, rtol=0, atol=0.05)
    assert (bf16.double() - exact).abs().max() > (fp32.double() - exact).abs().max()


@pytest.mark.parametrize(
    ("spec", "fast_bf16", "expected"),
    [
        ("auto", True, torch.bfloat16),
        ("auto", False, torch.float32),
        ("bf16", False, torch.bfloat16),
        ("fp32", True, torch.float32),
        ("fp16", True, torch.float16),
        (torch.float32, True, torch.float32),
    ],
)
def test_ns_dtype_auto_follows_the_device_probe(spec, fast_bf16, expected):
    """auto is bf16 only where bf16 GEMMs are fast; explicit settings ignore the probe."""
    asked = []

    def probe(device, dtype):
        asked.append((device, dtype))
        return fast_bf16

    assert ns.resolve_ns_dtype(spec, torch.device("cpu"), probe) is expected
    assert asked == ([(torch.device("cpu"), torch.bfloat16)] if spec == "auto" else [])


def test_orthogonalize_auto_dtype_runs_in_the_probed_dtype(monkeypatch):
    """On a device without fast bf16, auto computes in fp32: results equal fp32 NS exactly."""
    matrices = [_randn(12, 20, seed=s) for s in range(3)]
    seen = []
    real = ns.newton_schulz

    def recording(g, coefficients, eps=1e-7, dtype=torch.bfloat16):
        seen.append(dtype)
        return real(g, coefficients, eps, dtype)

    monkeypatch.setattr(ns, "newton_schulz", recording)
    out = orthogonalize(matrices, KELLER_5, strategy="loop", fast_matmul=lambda d, t: False)
    assert set(seen) == {torch.float32}
    for m, o in zip(matrices, out, strict=True):
        assert torch.equal(o, real(m, KELLER_5, dtype=torch.float32))


def test_ns_dtype_errors_name_the_value():
    """An unknown ns_dtype lists what is allowed."""
    with pytest.raises(ValueError, match=r"ns_dtype='int8' is invalid; use one of 'auto'"):
        orthogonalize([torch.ones(2, 2)], KELLER_5, ns_dtype="int8")


def _record_batch_sizes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = ns._run_batch

    def recording(stacked, kernel, strategy):
        sizes.append(stacked.shape[0])
        return real(stacked, kernel, strategy)

    monkeypatch.setattr(ns, "_run_batch", recording)
    return sizes


def test_orthogonalize_memory_budget_splits_batches(monkeypatch):
    """A budget for three [16, 16] matrices runs ten of them as 3 + 3 + 3 + 1, same results."""
    matrices = [_randn(16, 16, seed=s) for s in range(10)]
    unbounded = orthogonalize(matrices, KELLER_5, strategy="batched", ns_dtype="bf16")
    sizes = _record_batch_sizes(monkeypatch)
    budget = estimate_batch_bytes(16, 16, 3, torch.float32)
    capped = orthogonalize(
        matrices, KELLER_5, memory_budget_bytes=budget, strategy="batched", ns_dtype="bf16"
    )
    assert sizes == [3, 3, 3, 1]
    for a, b in zip(unbounded, capped, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_memory_budget_counts_the_compute_dtype(monkeypatch):
    """fp32 iterates take twice bf16's bytes: the same budget holds fewer matrices per batch."""
    matrices = [_randn(16, 16, seed=s) for s in range(6)]
    sizes = _record_batch_sizes(monkeypatch)
    budget = estimate_batch_bytes(16, 16, 3, torch.float32, torch.bfloat16)
    assert budget < estimate_batch_bytes(16, 16, 3, torch.float32, torch.float32)
    orthogonalize(matrices, KELLER_5, memory_budget_bytes=budget, ns_dtype="bf16")
    assert sizes == [3, 3]
    sizes.clear()
    orthogonalize(matrices, KELLER_5, memory_budget_bytes=budget, ns_dtype="fp32")
    assert max(sizes) < 3 and sum(sizes) == 6


def test_orthogonalize_memory_budget_splits_expert_tensor(monkeypatch):
    """An expert tensor larger than the budget is split, not run whole."""
    experts = _randn(7, 8, 8, seed=8)
    sizes = _record_batch_sizes(monkeypatch)
    budget = estimate_batch_bytes(8, 8, 3, torch.float32)
    (out,) = orthogonalize(
        [experts], KELLER_5, memory_budget_bytes=budget, strategy="batched", ns_dtype="bf16"
    )
    assert sizes == [3, 3, 1]
    for e in range(7):
        torch.testing.assert_close(out[e], newton_schulz(experts[e], KELLER_5), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("loop_s", "expected"), [(1.0, Strategy.LOOP), (2.0, Strategy.BATCHED)])
def test_orthogonalize_auto_measures_once_per_machine_and_caches(
    monkeypatch, tmp_path, loop_s, expected
):
    """auto times both strategies on the first sight of a key (a fake timer: the loop at
    ``loop_s``, batched at 2.0; a tie goes to batched), runs the faster, and a second call reads
    the decision back without timing; the results equal that strategy's own run."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "measure")
    monkeypatch.setenv("NPU_CORE_CACHE_DIR", str(tmp_path))
    timed: list[list[str]] = []

    def fake_timer(calls):
        timed.append(list(calls))
        return {"loop": loop_s, "batched": 2.0}

    ran = []
    real = ns._Kernel.batched

    def recording(self, stacked):
        ran.append(stacked.shape[0])
        return real(self, stacked)

    monkeypatch.setattr(ns._Kernel, "batched", recording)
    matrices = [_randn(8, 8, seed=s) for s in range(4)]
    with use_timer(fake_timer):
        first = orthogonalize(matrices, KELLER_5, ns_dtype="fp32")
    assert timed == [["loop", "batched"]]
    assert (4 in ran) is (expected is Strategy.BATCHED)
    [record] = (tmp_path / ns.STRATEGY_DECISIONS).glob("*.json")
    assert json.loads(record.read_text())["choice"] == expected.value

    decisions.forget()  # a new process: the answer comes from the file
    with use_timer(pytest.fail):
        second = orthogonalize(matrices, KELLER_5, ns_dtype="fp32")
    reference = orthogonalize(matrices, KELLER_5, ns_dtype="fp32", strategy=expected.value)
    for a, b, c in zip(first, second, reference, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_orthogonalize_auto_runs_batched_where_measuring_is_off(monkeypatch):
    """With ``NPU_CORE_DECISIONS=fallback`` nothing is timed and same-shape matrices run as one
    batch."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "fallback")
    sizes = _record_batch_sizes(monkeypatch)
    ran = []
    real = ns._Kernel.batched
    monkeypatch.setattr(ns._Kernel, "batched", lambda self, s: ran.append(len(s)) or real(self, s))
    with use_timer(pytest.fail):
        orthogonalize([_randn(8, 8, seed=s) for s in range(3)], KELLER_5, ns_dtype="fp32")
    assert sizes == [3] and ran == [3]


@pytest.mark.parametrize(
    ("kwargs", "matrices", "match"),
    [
        ({"strategy": "fast"}, [torch.ones(2, 2)], r"strategy='fast' is not one of"),
        ({"memory_budget_bytes": 0}, [torch.ones(2, 2)], r"memory_budget_bytes=0 is invalid"),
        ({}, [torch.ones(2, 2), torch.ones(3)], r"matrices\[1\] has shape \(3,\)"),
    ],
)
def test_orthogonalize_errors(kwargs, matrices, match):
    """Bad strategy, budget or matrix rank is reported with the offending value."""
    with pytest.raises(ValueError, match=match):
        orthogonalize(matrices, KELLER_5, **kwargs)
