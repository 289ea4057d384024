"""Newton-Schulz orthogonalisation for Muon: coefficient presets, the batched kernel, and a runner
that stacks same-shape matrices into memory-capped batches. Sharding and communication are left to
the callers (the distributed engine gathers whole matrices before calling in here).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import TypeGuard

import torch
from torch import Tensor

from npu_core import capability, decisions
from npu_core.device import synchronizer
from npu_core.timing import interleaved_timer

Coefficients = tuple[float, float, float]
"""(a, b, c) of one step p(X) = a X + b X X^T X + c (X X^T)^2 X."""

CoefficientSpec = str | Coefficients
"""A preset name (see :class:`CoefficientPreset`) or one (a, b, c) used for every step."""

KELLER: Coefficients = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic, the default of ``torch.optim.Muon``. Its fixed point is not 1
(p(1) = 0.701): singular values end in a band around 1 instead of converging, which is enough for
Muon and needs fewer steps than a convergent iteration."""

QUINTIC: Coefficients = (3.0, -3.2, 1.2)
"""A convergent quintic chosen here: p(1) = 1 exactly and p'(1) = -0.6, so singular values settle
at 1 (unlike KELLER), while the slope at 0 is 3 (KELLER: 3.4445), so small singular values still
grow almost as fast. The price is an overshoot to p(0.65) = 1.21 on the way."""

# Polar Express (Amsel, Persson, Musco, Gower, 2025, arXiv:2505.16932), Algorithm 1, degree 5:
# the published per-step schedule; steps past the list repeat the last entry, as in the paper.
_POLAR_EXPRESS_PUBLISHED: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The paper divides (a, b, c) by (s, s^3, s^5), s = 1.01, for every step but the last, so bf16
# round-off cannot push a singular value past the interval the polynomials were fitted on.
_POLAR_EXPRESS_SAFETY = 1.01


class CoefficientPreset(enum.StrEnum):
    """Named Newton-Schulz coefficient schedules."""

    KELLER = "keller"
    QUINTIC = "quintic"
    POLAR_EXPRESS = "polar_express"


class Strategy(enum.StrEnum):
    """How :func:`orthogonalize` runs a group of same-shape matrices."""

    AUTO = "auto"
    """Measure batched against loop the first time a (shape, dtype, count) is seen on this
    machine (the answer is cached on disk, per machine profile)."""
    BATCHED = "batched"
    """Stack into [B, M, N] and run one batched iteration."""
    LOOP = "loop"
    """One matrix at a time."""


class NsDtype(enum.StrEnum):
    """The dtype Newton-Schulz computes in (inputs and results keep their own dtype)."""

    AUTO = "auto"
    """bf16 where the device multiplies bf16 at least as fast as fp32 (CUDA sm80+, Ascend, CPUs
    with AVX512-BF16 / AMX / Arm BF16, confirmed by one timing), fp32 elsewhere: on an AVX2-only
    CPU a bf16 GEMM is emulated and ~75x slower than fp32."""
    BF16 = "bf16"
    """bf16 always: bit for bit ``torch.optim.Muon``, whatever it costs on this device."""
    FP32 = "fp32"
    """fp32 always: the most accurate, the fast choice on CPUs without native bf16."""
    FP16 = "fp16"
    """fp16 always (inputs are normalised, so the iteration stays in range)."""


_NS_TORCH_DTYPES = {
    NsDtype.BF16: torch.bfloat16,
    NsDtype.FP32: torch.float32,
    NsDtype.FP16: torch.float16,
}


def check_ns_dtype(spec: object) -> NsDtype:
    """Parse an ``ns_dtype`` argument: a :class:`NsDtype` name or one of its torch dtypes."""
    for name, dtype in _NS_TORCH_DTYPES.items():
        if spec is dtype:
            return name
    try:
        if not isinstance(spec, str):  # NsDtype would refuse it with the same ValueError
            raise ValueError(spec)
        return NsDtype(spec)
    except ValueError:
        allowed = ", ".join(repr(d.value) for d in NsDtype)
        raise ValueError(
            f"ns_dtype={spec!r} is invalid; use one of {allowed} (or torch.bfloat16, "
            "torch.float32, torch.float16)"
        ) from None


def resolve_ns_dtype(
    spec: NsDtype | str | torch.dtype,
    device: torch.device,
    fast_matmul: capability.MatmulSpeedProbe | None = None,
) -> torch.dtype:
    """The torch dtype Newton-Schulz runs in on ``device`` for an ``ns_dtype`` setting.

    Args:
        spec: See :class:`NsDtype`.
        device: Where the matrices are.
        fast_matmul: (device, dtype) -> whether that dtype's GEMMs are fast there; None asks
            :func:`npu_core.capability.fast_matmul` (the capability, confirmed by one timing per
            device and process). Tests inject their own.
    """
    name = check_ns_dtype(spec)
    if name is not NsDtype.AUTO:
        return _NS_TORCH_DTYPES[name]
    probe = capability.fast_matmul if fast_matmul is None else fast_matmul
    return torch.bfloat16 if probe(device, torch.bfloat16) else torch.float32


def _polar_express_schedule(steps: int) -> list[Coefficients]:
    s = _POLAR_EXPRESS_SAFETY
    published = _POLAR_EXPRESS_PUBLISHED
    scaled = [(a / s, b / s**3, c / s**5) for a, b, c in published[:-1]] + [published[-1]]
    return scaled[:steps] + [published[-1]] * max(0, steps - len(scaled))


def resolve_coefficients(spec: CoefficientSpec, steps: int) -> list[Coefficients]:
    """Expand a preset name or an (a, b, c) tuple into one (a, b, c) per Newton-Schulz step.

    ``"polar_express"`` is the published Polar Express schedule (arXiv:2505.16932, Algorithm 1,
    with its 1.01 safety scaling). Unlike that algorithm, :func:`newton_schulz` normalises by the
    Frobenius norm without the extra factor 1.01, to stay identical to ``torch.optim.Muon``.

    Args:
        spec: ``"keller"``, ``"quintic"``, ``"polar_express"`` or a tuple (a, b, c).
        steps: Number of Newton-Schulz steps, >= 1.

    Returns:
        ``steps`` coefficient tuples, one per step.

    Raises:
        ValueError: ``steps`` is not a positive int, the name is unknown, or the tuple is not three
            finite numbers.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"ns_steps={steps!r} is invalid; it must be an int >= 1")
    if isinstance(spec, str):
        try:
            preset = CoefficientPreset(spec)
        except ValueError:
            allowed = ", ".join(repr(p.value) for p in CoefficientPreset)
            raise ValueError(
                f"ns_coefficients={spec!r} is not a known preset; use one of {allowed} "
                "or a tuple (a, b, c)"
            ) from None
        if preset is CoefficientPreset.POLAR_EXPRESS:
            return _polar_express_schedule(steps)
        return [KELLER if preset is CoefficientPreset.KELLER else QUINTIC] * steps
    values = tuple(spec) if isinstance(spec, Sequence) else ()
    numbers = [v for v in values if _is_finite_number(v)]
    if len(values) != 3 or len(numbers) != 3:
        raise ValueError(
            f"ns_coefficients={spec!r} is invalid; give a preset name or three finite numbers "
            "(a, b, c)"
        )
    a, b, c = (float(v) for v in numbers)
    return [(a, b, c)] * steps


def _is_finite_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def newton_schulz(
    g: Tensor,
    coefficients: Sequence[Coefficients],
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalise each matrix of ``g`` (map U S V^T to about U V^T).

    With the default ``dtype=torch.bfloat16`` this matches
    ``torch.optim._muon._zeropower_via_newtonschulz`` bit for bit on 2-D inputs: the iteration
    runs in bf16, the input is divided by its Frobenius norm (clamped below by ``eps``), and a
    tall matrix is transposed so the Gram matrix is the smaller [min, min] one. Inputs with
    leading dims are a batch: every matrix gets its own norm and the same transpose rule.

    Args:
        g: [..., M, N], floating point. Not modified.
        coefficients: One (a, b, c) per step, e.g. from :func:`resolve_coefficients`.
        eps: Lower bound of the norm, so an all-zero matrix maps to zeros instead of NaN.
        dtype: The compute dtype (see :func:`resolve_ns_dtype` for choosing one per device).

    Returns:
        [..., M, N] in ``g``'s dtype, computed in ``dtype``.

    Raises:
        ValueError: ``g`` has fewer than two dims or is not floating point, or no coefficients.
    """
    if g.ndim < 2 or not g.is_floating_point():
        raise ValueError(
            f"newton_schulz needs a floating-point tensor [..., M, N], got shape "
            f"{tuple(g.shape)} and dtype {g.dtype}"
        )
    if not coefficients:
        raise ValueError("newton_schulz needs at least one (a, b, c) step")
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype)
    if tall:
        x = x.mT
    if g.ndim == 2:
        x = _iterate_matrix(x, coefficients, eps)
    else:
        rows, cols = x.shape[-2:]
        x = _iterate_batch(x.reshape(-1, rows, cols), coefficients, eps).reshape(x.shape)
    if tall:
        x = x.mT
    return x.to(g.dtype)


def _iterate_matrix(x: Tensor, coefficients: Sequence[Coefficients], eps: float) -> Tensor:
    # Same ops in the same order as torch.optim.Muon; the fused addmm rounds once to bf16, a
    # separate matmul and add would round twice and drift from the reference.
    x = x / x.norm().clamp(min=eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x


def _iterate_batch(x: Tensor, coefficients: Sequence[Coefficients], eps: float) -> Tensor:
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = x / norms.clamp(min=eps)
    for a, b, c in coefficients:
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def estimate_batch_bytes(
    rows: int,
    cols: int,
    count: int,
    dtype: torch.dtype,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Peak memory estimate of running :func:`newton_schulz` on ``count`` [rows, cols] matrices.

    Counts the stacked input and the result in ``dtype``, plus the working set in
    ``compute_dtype`` at its peak: two iterates [min, max] and the Gram matrix with its
    polynomial, two [min, min].
    """
    small, large = min(rows, cols), max(rows, cols)
    itemsize = dtype.itemsize
    work = compute_dtype.itemsize
    per_matrix = 2 * small * large * itemsize + work * (2 * small * large + 2 * small * small)
    return count * per_matrix


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Matrices ``start:stop`` of input ``index`` (a 2-D input has the single matrix 0:1)."""

    index: int
    start: int
    stop: int


def _plan_batches(
    matrices: Sequence[Tensor],
    memory_budget_bytes: int | None,
    compute_dtype: Callable[[torch.device], torch.dtype],
) -> list[list[_Segment]]:
    """Group matrices by (M, N, dtype, device) and cut each group into budget-sized batches."""
    groups: dict[tuple[int, int, torch.dtype, torch.device], list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((m.shape[-2], m.shape[-1], m.dtype, m.device), []).append(i)
    batches: list[list[_Segment]] = []
    for (rows, cols, dtype, device), indices in groups.items():
        per_matrix = estimate_batch_bytes(rows, cols, 1, dtype, compute_dtype(device))
        # A single matrix over the budget still runs, alone: there is nothing smaller to run.
        capacity = (
            math.inf if memory_budget_bytes is None else max(1, memory_budget_bytes // per_matrix)
        )
        current: list[_Segment] = []
        filled = 0
        for i in indices:
            count = 1 if matrices[i].ndim == 2 else matrices[i].shape[0]
            start = 0
            while start < count:
                take = int(min(count - start, capacity - filled))
                current.append(_Segment(i, start, start + take))
                filled += take
                start += take
                if filled == capacity:
                    batches.append(current)
                    current, filled = [], 0
        if current:
            batches.append(current)
    return batches


def _as_batch(m: Tensor) -> Tensor:
    return m.unsqueeze(0) if m.ndim == 2 else m


def _stack(matrices: Sequence[Tensor], segments: Sequence[_Segment]) -> Tensor:
    pieces = [_as_batch(matrices[s.index])[s.start : s.stop] for s in segments]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """One Newton-Schulz configuration, run on a [B, M, N] stack batched or one matrix at a time."""

    coefficients: Sequence[Coefficients]
    eps: float
    dtype: torch.dtype

    def batched(self, stacked: Tensor) -> Tensor:
        return newton_schulz(stacked, self.coefficients, self.eps, self.dtype)

    def loop(self, stacked: Tensor) -> Tensor:
        return torch.stack(
            [newton_schulz(m, self.coefficients, self.eps, self.dtype) for m in stacked]
        )


STRATEGY_DECISIONS = "ns-strategy"
"""The batched-or-loop decisions' namespace in ``npu_core.decisions`` (folder, timer scope)."""

STRATEGY_ROUNDS = 5
"""Interleaved rounds per strategy decision: a large batch takes milliseconds per call, and the
first optimizer step pays for every round."""


def _choose_strategy(stacked: Tensor, kernel: _Kernel) -> Strategy:
    """Batched or loop for this batch, measured once per (M, N, dtypes, count) and machine.

    No static rule is right everywhere (batching 200 [64, 64] matrices was measured 15x faster
    than a loop on one CPU, batching 74 [24, 10240] in bf16 3x slower), so it is measured on the
    machine that runs it (:func:`npu_core.decisions.decide`: interleaved rounds, medians, a tie
    to batched; cached on disk per machine profile, which names the device). Where measuring is
    switched off (``NPU_CORE_DECISIONS``) the batch runs batched.
    """
    count, rows, cols = stacked.shape
    fields = {
        "rows": rows,
        "cols": cols,
        "count": count,
        "dtype": str(stacked.dtype),
        "ns_dtype": str(kernel.dtype),
    }
    decision = decisions.decide(
        STRATEGY_DECISIONS,
        fields,
        {
            Strategy.LOOP.value: lambda: kernel.loop(stacked),
            Strategy.BATCHED.value: lambda: kernel.batched(stacked),
        },
        fallback=Strategy.BATCHED.value,
        baseline=Strategy.LOOP.value,
        device=stacked.device,
        timer=functools.partial(
            interleaved_timer,
            rounds=STRATEGY_ROUNDS,
            sync=synchronizer(stacked.device),
        ),
    )
    return Strategy(decision.name)


def _run_batch(stacked: Tensor, kernel: _Kernel, strategy: Strategy) -> Tensor:
    """Orthogonalise a [B, M, N] stack with the given strategy (AUTO resolved here)."""
    if stacked.shape[0] == 1:
        return kernel.loop(stacked)
    if strategy is Strategy.AUTO:
        strategy = _choose_strategy(stacked, kernel)
    return kernel.batched(stacked) if strategy is Strategy.BATCHED else kernel.loop(stacked)


def check_memory_budget(memory_budget_bytes: object, owner: str = "") -> None:
    """Raise ValueError unless ``memory_budget_bytes`` is a positive int or None."""
    if memory_budget_bytes is not None and (
        isinstance(memory_budget_bytes, bool)
        or not isinstance(memory_budget_bytes, int)
        or memory_budget_bytes <= 0
    ):
        raise ValueError(
            f"{owner}memory_budget_bytes={memory_budget_bytes!r} is invalid; use a positive int "
            "or None"
        )


def orthogonalize(
    matrices: Sequence[Tensor],
    coefficients: Sequence[Coefficients],
    *,
    eps: float = 1e-7,
    memory_budget_bytes: int | None = None,
    strategy: Strategy | str = Strategy.AUTO,
    ns_dtype: NsDtype | str | torch.dtype = NsDtype.AUTO,
    fast_matmul: capability.MatmulSpeedProbe | None = None,
) -> list[Tensor]:
    """Run :func:`newton_schulz` on many matrices, batching those of the same shape and dtype.

    Same-shape matrices are stacked into [B, M, N] batches whose estimated working memory
    (:func:`estimate_batch_bytes`) stays under ``memory_budget_bytes``; a 3-D expert tensor larger
    than the budget is split across batches rather than run whole, so MoE layers cannot blow the
    budget.

    Args:
        matrices: Each [M, N], or [E, M, N] meaning E independent matrices (MoE experts);
            floating point, any mix of shapes, dtypes and devices.
        coefficients: One (a, b, c) per step, e.g. from :func:`resolve_coefficients`.
        eps: Lower bound of each matrix's norm.
        memory_budget_bytes: Cap on one batch's estimated working memory; None for no cap.
        strategy: ``"batched"``, ``"loop"``, or ``"auto"`` (measure both once per shape, dtype,
            batch size and machine profile, then reuse the faster; cached on disk).
        ns_dtype: The compute dtype, resolved per device by :func:`resolve_ns_dtype`.
        fast_matmul: The speed probe ``ns_dtype="auto"`` asks (None: npu_core's; tests inject one).

    Returns:
        One tensor per input, same shape and dtype, in input order.

    Raises:
        ValueError: A matrix is not 2-D or 3-D floating point, the budget is not a positive int,
            the strategy or the ns_dtype is unknown.
    """
    for i, m in enumerate(matrices):
        if m.ndim not in (2, 3) or not m.is_floating_point():
            raise ValueError(
                f"matrices[{i}] has shape {tuple(m.shape)} and dtype {m.dtype}; orthogonalize "
                "takes floating-point [M, N] or [E, M, N] tensors"
            )
    check_memory_budget(memory_budget_bytes)
    try:
        chosen = Strategy(strategy)
    except ValueError:
        allowed = ", ".join(repr(s.value) for s in Strategy)
        raise ValueError(f"strategy={strategy!r} is not one of {allowed}") from None

    check_ns_dtype(ns_dtype)

    @functools.cache
    def compute_dtype(device: torch.device) -> torch.dtype:
        return resolve_ns_dtype(ns_dtype, device, fast_matmul)

    pieces: list[list[Tensor]] = [[] for _ in matrices]
    for segments in _plan_batches(matrices, memory_budget_bytes, compute_dtype):
        stacked = _stack(matrices, segments)
        kernel = _Kernel(coefficients, eps, compute_dtype(stacked.device))
        result = _run_batch(stacked, kernel, chosen)
        offset = 0
        for s in segments:
            size = s.stop - s.start
            pieces[s.index].append(result[offset : offset + size])
            offset += size
    out = []
    for m, parts in zip(matrices, pieces, strict=True):
        if not parts:  # an expert tensor with E = 0
            out.append(torch.empty_like(m))
            continue
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        out.append(whole.reshape(m.shape))
    return out
