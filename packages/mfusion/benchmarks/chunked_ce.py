"""Training step of an LM head + cross-entropy: plain Inductor vs the chunked cross-entropy pass.

Measures, for ``hidden -> Linear(H, H) -> Linear(H, V) -> F.cross_entropy`` (fp32, 1/8 of the
targets ignored) at a shape where the logits dominate:

* bytes saved for backward: the inputs of the compiled backward graph (deterministic);
* peak resident memory: ``ru_maxrss`` of a fresh subprocess per variant that compiles and runs
  a few steps (includes the interpreter, torch and compilation);
* step time (forward + backward): both variants compiled in one process, timed in interleaved
  rounds; the median of the per-round ratios.

Run with one thread on one core, e.g. ``taskset -c 1 python benchmarks/chunked_ce.py``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import mfusion

VARIANTS = ("inductor", "chunked")


class LMHead(torch.nn.Module):
    """The last block's projection, the output head and the loss."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.proj(x)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


class SavedBytes(CustomGraphPass):
    """Post-grad pre-pass hook: sums the bytes of the backward graph's non-tangent inputs."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, tuple[int, ...], int]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        if not any(n.name.startswith("tangents") for n in inputs):
            return
        for node in inputs:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and not node.name.startswith("tangents"):
                size = value.numel() * value.element_size()
                self.saved.append((node.name, tuple(value.shape), size))

    def uuid(self) -> str:
        return "saved-bytes"


def build(args: argparse.Namespace, variant: str) -> tuple[Any, LMHead, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = LMHead(args.hidden, args.vocab)
    x = torch.randn(args.batch, args.seq, args.hidden)
    target = torch.randint(0, args.vocab, (args.batch, args.seq))
    target.view(-1)[::8] = -100
    if variant == "inductor":
        compiled = torch.compile(model)
    else:
        options = mfusion.compile_options(
            backend="inductor", passes=(), auto_fuse=False, chunked_cross_entropy=True
        )
        compiled = torch.compile(model, options=options)
    return compiled, model, x, target


def step(compiled: Any, model: LMHead, x: torch.Tensor, target: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    loss = compiled(x, target)
    loss.backward()
    return float(loss)


def child(args: argparse.Namespace) -> None:
    """One variant in this fresh process: saved bytes, loss and peak RSS as one JSON line."""
    torch.set_num_threads(1)
    recorder = SavedBytes()
    inductor_config.post_grad_custom_pre_pass = recorder
    inductor_config.force_disable_caches = True
    compiled, model, x, target = build(args, args.child)
    losses = [step(compiled, model, x, target) for _ in range(3)]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    decisions = [d.reason for g in mfusion.report() for d in g.decisions]
    print(
        json.dumps(
            {
                "variant": args.child,
                "saved_bytes": sum(s for _, _, s in recorder.saved),
                "largest_saved": sorted(recorder.saved, key=lambda s: -s[2])[:3],
                "peak_rss_mib": peak_kib / 1024,
                "loss": losses[-1],
                "decisions": decisions,
            }
        )
    )


def timed_rounds(args: argparse.Namespace) -> dict[str, float]:
    """Both variants in this process, interleaved: median per-round time ratio."""
    torch.set_num_threads(1)
    built = {v: build(args, v) for v in VARIANTS}
    for v in VARIANTS:
        for _ in range(2):
            step(*built[v])
    ratios, times = [], {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            start = time.perf_counter()
            step(*built[v])
            times[v].append(time.perf_counter() - start)
        ratios.append(times["chunked"][-1] / times["inductor"][-1])
    ratios.sort()
    quart = len(ratios) // 4
    return {
        "inductor_ms": 1e3 * statistics.median(times["inductor"]),
        "chunked_ms": 1e3 * statistics.median(times["chunked"]),
        "ratio_median": statistics.median(ratios),
        "ratio_p25": ratios[quart],
        "ratio_p75": ratios[-1 - quart],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=11, help="interleaved timing rounds")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    shape = ["--batch", str(args.batch), "--seq", str(args.seq)]
    shape += ["--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    memory = {}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, *shape],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        memory[variant] = json.loads(out.strip().splitlines()[-1])
    timing = timed_rounds(args)
    print(json.dumps({"shape": vars(args), "memory": memory, "timing": timing}, indent=1))
    base, new = memory["inductor"], memory["chunked"]
    print(
        f"saved for backward: {base['saved_bytes'] / 2**20:.1f} MiB -> "
        f"{new['saved_bytes'] / 2**20:.1f} MiB; peak RSS {base['peak_rss_mib']:.0f} MiB -> "
        f"{new['peak_rss_mib']:.0f} MiB; step {timing['inductor_ms']:.0f} ms -> "
        f"{timing['chunked_ms']:.0f} ms (chunked/inductor median {timing['ratio_median']:.3f}, "
        f"p25-p75 {timing['ratio_p25']:.3f}-{timing['ratio_p75']:.3f})"
    )


if __name__ == "__main__":
    main()
