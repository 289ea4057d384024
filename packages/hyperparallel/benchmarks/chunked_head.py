"""The output head + cross-entropy at a real vocabulary: chunked versus plain logits.

``chunked_linear_cross_entropy(hidden, weight, target)`` (hyperparallel's head loss, computed by
``npu_core.chunked_ce``: row chunks, no ``[tokens, vocab]`` logits kept, each chunk's logits
recomputed in backward) against the plain
``F.cross_entropy(hidden @ weight.T, target)`` that a transformers model computes, at Qwen3's
vocabulary (151,936) and a few token counts. One process, fp32, forward + backward of the loss
with gradients for ``hidden`` and ``weight``.

- peak MiB: the rise of the process's peak resident set size during one forward + backward above
  the resident size just before it (Linux ``VmHWM``, reset before each call through
  ``npu_core.memory.reset_peak_memory_stats``). glibc is told to serve every allocation of
  256 KiB or more with its own mapping (``mallopt(M_MMAP_THRESHOLD)``), so freed tensors leave
  the resident set at once and the peak follows live tensor bytes; inputs and weights exist
  before the call and are not counted, the gradients the call creates are. Measured once per
  variant, in a call that is not timed.
- time: ``npu_core.bench.compare`` interleaves the two (A B, B A, ...) so that load from other
  jobs hits both alike; the ratio is the median of per-round ratios.

    uv run python packages/hyperparallel/benchmarks/chunked_head.py --out DIR
        [--tokens 1024 4096] [--hidden 64] [--vocab 151936] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from hyperparallel.models.lm_loss import DEFAULT_CHUNK_ROWS, chunked_linear_cross_entropy
from npu_core.bench import BenchTable, compare
from npu_core.memory import memory_stats, reset_peak_memory_stats

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def map_large_allocations(threshold: int = 256 * 1024) -> bool:
    """Serve allocations of ``threshold`` bytes or more by mmap, so that freeing them shrinks the
    resident set at once (glibc only; returns whether it took effect)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def peak_rise_bytes(fn: Callable[[], object]) -> int:
    """Peak resident set size during ``fn()`` minus the resident size before it."""
    before = memory_stats("cpu").host_rss_bytes
    reset_peak_memory_stats("cpu")
    fn()
    return memory_stats("cpu").peak_allocated_bytes - before


def _inputs(tokens: int, hidden: int, vocab: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=gen)).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).requires_grad_()
    t = torch.randint(vocab, (tokens,), generator=gen)
    return h, w, t


def measure(tokens: int, hidden: int, vocab: int, repeats: int) -> dict[str, float]:
    """Peak memory (one untimed call each) and interleaved times of both heads at one size."""
    h, w, t = _inputs(tokens, hidden, vocab)
    losses: dict[str, float] = {}

    def plain() -> None:
        loss = F.cross_entropy(h @ w.T, t)
        loss.backward()
        losses["plain"] = loss.item()
        h.grad = w.grad = None

    def chunked() -> None:
        loss = chunked_linear_cross_entropy(h, w, t)
        loss.backward()
        losses["chunked"] = loss.item()
        h.grad = w.grad = None

    peaks = {"plain": peak_rise_bytes(plain), "chunked": peak_rise_bytes(chunked)}
    timing = compare(plain, chunked, warmup=0, repeats=repeats)
    return {
        "logits MiB (tokens x vocab fp32)": tokens * vocab * 4 / 2**20,
        "plain peak MiB": peaks["plain"] / 2**20,
        "chunked peak MiB": peaks["chunked"] / 2**20,
        "chunked / plain peak": peaks["chunked"] / peaks["plain"],
        "plain ms": timing.baseline.median * 1e3,
        "chunked ms": timing.candidate.median * 1e3,
        "chunked / plain time": 1 / timing.ratio_median,
        "max |loss diff|": abs(losses["plain"] - losses["chunked"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    mapped = map_large_allocations()
    table = BenchTable(
        f"Output head + cross-entropy, vocab {args.vocab}, hidden {args.hidden}, fp32, forward + "
        f"backward (chunk {DEFAULT_CHUNK_ROWS} rows; median of {args.repeats} interleaved rounds)",
        [
            "tokens",
            "logits MiB (tokens x vocab fp32)",
            "plain peak MiB",
            "chunked peak MiB",
            "chunked / plain peak",
            "plain ms",
            "chunked ms",
            "chunked / plain time",
            "max |loss diff|",
        ],
        metadata={"mmap_threshold_set": mapped, "chunk_rows": DEFAULT_CHUNK_ROWS},
    )
    for tokens in args.tokens:
        row = measure(tokens, args.hidden, args.vocab, args.repeats)
        table.add(tokens=tokens, **row)
        print(tokens, row, flush=True)
    _, md_path = table.write(args.out, "chunked_head")
    print(md_path.read_text())


if __name__ == "__main__":
    main()
