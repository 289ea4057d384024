"""Benchmark: saved-activation bytes by placement and step time, on the train CLI's model.

One training step (forward, backward) of ``hyperparallel train``'s default MoE transformer and
batch, one process, for: no checkpoint; torch full recompute (``torch.utils.checkpoint``,
non-reentrant); torch selective checkpoint (``create_selective_checkpoint_contexts`` saving the
same matmul/attention ops); ``torch.autograd.graph.save_on_cpu``; and hyperparallel policies.
Bytes are counted exactly by storage from saved-tensor hooks (weights excluded); for the torch
variants the same counting runs through hooks that delegate to torch's own. Step times are
measured in interleaved rounds against no checkpoint (``npu_core.bench.compare``).

On a CPU-only machine "host" and "device" are the same memory and copies are synchronous: the
placement columns say where each byte would live on an accelerator, and swap copy/compute overlap
is not measured here.

Run: ``uv run nox -s bench`` or ``uv run python packages/hyperparallel/benchmarks/activation.py
--out DIR``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from hyperparallel.activation import (
    MATMUL_OPS,
    ActivationReport,
    ActivationTracker,
    SwapSchedule,
    checkpoint_wrapper,
    resolve,
)
from hyperparallel.activation.report import storage_key
from hyperparallel.data.stdlib_bytes import ByteBatches, read_corpus
from hyperparallel.models.moe import MoETransformer
from hyperparallel.train.presets import default
from npu_core.bench import BenchTable, compare, measure

REPEATS = 9
SWAP_THRESHOLD = 1 << 16


class _SacSaved(TorchDispatchMode):
    """Sits below torch's SAC caching mode and counts the outputs its policy keeps."""

    def __init__(self, tracker: ActivationTracker) -> None:
        super().__init__()
        self.tracker, self.saving = tracker, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.saving:
            for t in torch.utils._pytree.tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.tracker.add_tensor(t, "device")
                    self.tracker.sac_saved.add(storage_key(t)[0])
        self.saving = False
        return out


def _torch_checkpointed(model: MoETransformer, selective: bool) -> MoETransformer:
    """Blocks under torch's non-reentrant checkpoint, with its saved bytes counted."""
    state: dict = {}

    def policy(ctx, op, *args, **kwargs):
        save = op in MATMUL_OPS
        if not ctx.is_recompute and state.get("sac") is not None:
            state["sac"].saving = save
        return TorchPolicy.MUST_SAVE if save else TorchPolicy.PREFER_RECOMPUTE

    for layer in model.layers:
        original = layer.forward

        def counted(*args, _original=original, **kwargs):
            tracker = state.get("tracker")
            if tracker is None or state.get("replaying"):
                return _original(*args, **kwargs)
            for t in args:
                if isinstance(t, torch.Tensor):
                    tracker.add_tensor(t, "device")  # held by the checkpoint for recompute
            with _RecomputedTap(tracker):
                return _original(*args, **kwargs)

        def forward(*args, _counted=counted, **kwargs):
            kw = {"use_reentrant": False}
            if selective:
                kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
            return torch_checkpoint(_counted, *args, **kw, **kwargs)

        layer.forward = forward
    model._bench_state = state
    return model


class _RecomputedTap:
    """Inside a torch region: count packed tensors as recomputed unless SAC kept them."""

    def __init__(self, tracker: ActivationTracker) -> None:
        self.tracker = tracker

    def __enter__(self) -> None:
        tracker = self.tracker
        top_pack, top_unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(t: torch.Tensor):
            if storage_key(t)[0] not in tracker.sac_saved:
                tracker.add_tensor(t, "recomputed")
                # torch frees recomputable tensors after packing; holding them until forward
                # ends keeps storage addresses unique, so views of one storage count once.
                tracker.held.append(t)
            return top_pack(t)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, top_unpack)
        self._hooks.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _build(variant: str, base: MoETransformer) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """A step function returning the saved-activation report of its forward."""
    model = copy.deepcopy(base)
    schedule_kw: dict = {}
    outside = "device"
    if variant == "torch save_on_cpu":
        outside = "host"
    elif variant.startswith("torch"):
        _torch_checkpointed(model, selective=variant == "torch selective checkpoint")
    elif variant.startswith("hyperparallel"):
        name, _, extra = variant.removeprefix("hyperparallel ").partition(" + ")
        for layer in model.layers:
            checkpoint_wrapper(
                layer, resolve(name, SWAP_THRESHOLD), swap_inputs=extra == "swap_inputs"
            )
        schedule_kw = {"prefetch_ahead": 1}
    state = getattr(model, "_bench_state", {})

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> ActivationReport:
        model.zero_grad(set_to_none=True)
        tracker = ActivationTracker(outside)
        tracker.sac_saved, tracker.held = set(), []
        with _outer(variant), tracker, SwapSchedule(**schedule_kw):
            state["tracker"] = tracker
            sac = _SacSaved(tracker) if variant == "torch selective checkpoint" else None
            state["sac"] = sac
            with sac or _nothing():
                logits, balance = model(tokens)
            state["tracker"] = state["sac"] = None
            tracker.held.clear()
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        state["replaying"] = True
        (loss + 0.01 * balance).backward()
        state["replaying"] = False
        return tracker.report()

    return step


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _outer(variant: str):
    if variant == "torch save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    return _nothing()


VARIANTS = (
    "no checkpoint",
    "torch full recompute",
    "torch selective checkpoint",
    "torch save_on_cpu",
    "hyperparallel selective",
    "hyperparallel selective + swap_inputs",
    "hyperparallel selective_swap + swap_inputs",
    "hyperparallel swap",
    "hyperparallel swap + swap_inputs",
    "hyperparallel recompute + swap_inputs",
)


def _cpu_times(steps: dict, tokens: torch.Tensor, targets: torch.Tensor, rounds: int) -> dict:
    """Thread CPU time per step, all variants interleaved in every round (rotating order).

    Wall time on a shared machine includes time spent descheduled; the step is single-threaded
    and CPU-bound, so its CPU time is the steadier measure of the bookkeeping each variant adds.
    """
    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            began = time.thread_time()
            steps[name](tokens, targets)
            samples[name].append(time.thread_time() - began)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Directory for the JSON and Markdown table.")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="Interleaved rounds.")
    args = parser.parse_args()
    # One intra-op thread: on a shared 2-core machine this keeps the interleaved rounds
    # comparable (every variant runs the same kernels, only the bookkeeping differs).
    torch.set_num_threads(1)
    cfg = default()
    torch.manual_seed(cfg.seed)
    base = MoETransformer(cfg.model)
    data = ByteBatches(read_corpus(None, 400_000), cfg.data.seq_len, 0.05, cfg.seed)
    tokens, targets = data.train_batch(0, 0, cfg.data.batch_size)
    steps = {v: _build(v, base) for v in VARIANTS}
    reports = {v: steps[v](tokens, targets) for v in VARIANTS}
    baseline = steps["no checkpoint"]
    none = reports["no checkpoint"]
    table = BenchTable(
        f"Saved activations and step time, train CLI model (dim {cfg.model.dim}, "
        f"{cfg.model.n_layers} blocks, batch {cfg.data.batch_size} x {cfg.data.seq_len}), "
        f"CPU, 1 thread, median of {args.repeats}",
        [
            "variant",
            "device MiB",
            "host MiB",
            "recomputed MiB",
            "device vs none",
            "step ms",
            "time vs none",
            "CPU time vs none",
            "target met",
        ],
        {
            "swap_threshold_bytes": SWAP_THRESHOLD,
            "target": "device <= 0.4 x none at CPU time <= 1.2 x none",
            "overlap_on_accelerator": "not measured (no GPU here)",
        },
    )
    cpu = _cpu_times(steps, tokens, targets, args.repeats)
    for variant in VARIANTS:
        report = reports[variant]
        cpu_ratio = statistics.median(cpu[variant]) / statistics.median(cpu["no checkpoint"])
        if variant == "no checkpoint":
            ms = measure(lambda: baseline(tokens, targets), repeats=args.repeats).median * 1e3
            ratio = 1.0
        else:
            timing = compare(
                lambda: baseline(tokens, targets),
                lambda c=steps[variant]: c(tokens, targets),
                warmup=1,
                repeats=args.repeats,
            )
            ms, ratio = timing.candidate.median * 1e3, 1 / timing.ratio_median
        fraction = report.device_bytes / none.device_bytes
        table.add(
            variant=variant,
            **{
                "device MiB": report.device_bytes / 2**20,
                "host MiB": report.host_bytes / 2**20,
                "recomputed MiB": report.recomputed_bytes / 2**20,
                "device vs none": fraction,
                "step ms": ms,
                "time vs none": ratio,
                "CPU time vs none": cpu_ratio,
                "target met": ""
                if variant == "no checkpoint"
                else ("yes" if fraction <= 0.4 and cpu_ratio <= 1.2 else "no"),
            },
        )
        print(
            f"{variant:45s} device x{fraction:.3f}  time x{ratio:.2f}  cpu x{cpu_ratio:.2f}",
            flush=True,
        )
    _, md_path = table.write(args.out, "activation")
    print(md_path.read_text())


if __name__ == "__main__":
    main()
