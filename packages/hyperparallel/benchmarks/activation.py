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
from npu_core.bench import BenchTable, compare

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
    "hyperparallel selective_swap",
    "hyperparallel selective_swap + swap_inputs",
    "hyperparallel swap",
    "hyperparallel swap + swap_inputs",
    "hyperparallel recompute + swap_inputs",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Directory for the JSON and Markdown table.")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="Interleaved rounds.")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
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
        f"CPU, median of {args.repeats}",
        [
            "variant",
            "device MiB",
            "host MiB",
            "recomputed MiB",
            "device vs none",
            "step ms",
            "time vs none",
        ],
        {"swap_threshold_bytes": SWAP_THRESHOLD, "overlap_on_accelerator": "not measured"},
    )
    for variant in VARIANTS:
        report = reports[variant]
        if variant == "no checkpoint":
            ms, ratio = None, 1.0
            timing = compare(
                lambda: baseline(tokens, targets),
                lambda: baseline(tokens, targets),
                warmup=1,
                repeats=args.repeats,
            )
            ms = timing.baseline.median * 1e3
        else:
            candidate = steps[variant]
            timing = compare(
                lambda: baseline(tokens, targets),
                lambda c=candidate: c(tokens, targets),
                warmup=1,
                repeats=args.repeats,
            )
            ms, ratio = timing.candidate.median * 1e3, 1 / timing.ratio_median
        table.add(
            variant=variant,
            **{
                "device MiB": report.device_bytes / 2**20,
                "host MiB": report.host_bytes / 2**20,
                "recomputed MiB": report.recomputed_bytes / 2**20,
                "device vs none": report.device_bytes / none.device_bytes,
                "step ms": ms,
                "time vs none": ratio,
            },
        )
        print(f"{variant:45s} {report}  {ms:.1f} ms  x{ratio:.2f}", flush=True)
    _, md_path = table.write(args.out, "activation")
    print(md_path.read_text())


if __name__ == "__main__":
    main()
