"""Wan2.1-1.3B blocks at the 480p x 81-frame latent grid: each boost per block, and 30 blocks.

A ``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's dimensions (dim 1536, 12 heads x 128, FFN
8960, text dim 4096, 512 text tokens; random weights, fp32) but only ``--layers`` of its 30
blocks runs one forward on the latent of a 480 x 832, 81-frame video (16 x 21 x 60 x 104: after
the 1 x 2 x 2 patch, 21 x 30 x 52 = 32760 tokens). Variants run in interleaved rounds (the order
rotates each round):

- ``stock``: diffusers' processors and RoPE;
- ``rope``: liteboost's processor at sparsity 0 (dense SDPA chain) with cached fp32 RoPE;
- ``sparse``: block-sparse self-attention at ``--sparsity``, diffusers' RoPE;
- ``sparse+rope``: both (the combination a user turns on).

Each block's forward is timed by forward hooks; ``rest`` is the forward minus its blocks (patch
embedding, text and time embedding, RoPE tables, output head). ``--clock cpu`` (the CPU default)
times the process's CPU seconds (``time.process_time``, all intra-op threads) instead of wall
time: on a machine shared with other jobs the wall time of one forward moved by 35% between
identical calls, the CPU time of the compute much less. Run it with ``OMP_WAIT_POLICY=PASSIVE``
so that waiting OpenMP threads sleep instead of spinning (spinning counts as CPU time).

``--device cuda`` runs model and inputs on the GPU (``--dtype bf16`` for the dtype Wan is served
in) and times wall clock only: every clock read synchronises the device first, so a block's time
is its kernels' time, not how fast they were queued (CPU time would measure the queueing). The
sparse variants then run the CUDA chain's kernel (FlexAttention); the warm-up runs at the
measured shape, so its one-off compile is not timed.

The whole-transformer projection is ``rest + 30 x block`` per variant. Step caching is stated as
a per-step fraction: a step the first-block cache skips runs ``rest + 1 block`` (the first block
decides, the others are replaced by the cached residual), so its cost relative to a full step
follows from the same two numbers.

    python packages/liteboost/benchmarks/wan_blocks.py --out DIR [--frames 21] [--rounds 2]
    python packages/liteboost/benchmarks/wan_blocks.py --out DIR --device cuda --dtype bf16 \
        --layers 2 --rounds 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import liteboost
from liteboost.ops.cpu_extension import load_cpu_kernel
from npu_core.bench import BenchTable, Timing

WAN_1_3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
WAN_BLOCKS = 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TEXT_TOKENS = 512
LATENT_HW = (60, 104)  # 480 x 832 pixels / 8
VARIANTS = ("stock", "rope", "sparse", "sparse+rope")


def build_model(
    layers: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The Wan2.1-1.3B transformer with ``layers`` blocks, random weights, eval mode."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN_1_3B, num_layers=layers).eval().to(device)
    if dtype != torch.float32:
        # As ``from_pretrained(torch_dtype=...)`` loads it: the modules diffusers keeps in fp32
        # (RoPE buffers, time embedder, modulation tables, norms) stay in their dtype.
        keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, module in model.named_modules():
            for attr, tensors in (
                ("_parameters", module._parameters),
                ("_buffers", module._buffers),
            ):
                for key, t in list(tensors.items()):
                    full = f"{name}.{key}" if name else key
                    if t is None or not t.is_floating_point() or any(m in full for m in keep):
                        continue
                    if attr == "_parameters":
                        t.data = t.data.to(dtype)
                    else:
                        tensors[key] = t.to(dtype)
    return model


def boost_for(model, variant: str, sparsity: float):
    """The BoostManager (or None) that turns ``variant`` on."""
    if variant == "stock":
        return None
    sparse = sparsity if variant.startswith("sparse") else 0.0
    return liteboost.BoostManager(model, sparsity=sparse, rope_cache=variant.endswith("rope"))


class BlockClock:
    """Times every block forward of a model through torch forward hooks."""

    def __init__(self, model, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: list[float] = []
        self._start = 0.0
        self.handles = []
        for block in model.blocks:
            self.handles.append(block.register_forward_pre_hook(self._pre))
            self.handles.append(block.register_forward_hook(self._post))

    def _pre(self, *_: object) -> None:
        self._start = self.clock()

    def _post(self, *_: object) -> None:
        self.times.append(self.clock() - self._start)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def inputs(
    frames: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Seeded latent and text states (drawn on CPU, so every device gets the same values)."""
    gen = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 16, frames, *LATENT_HW, generator=gen).to(device, dtype),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 4096, generator=gen).to(device, dtype),
    )


def _synced_wall_clock(device: torch.device) -> Callable[[], float]:
    """Wall clock that first waits for the device's queued kernels."""
    module = getattr(torch, device.type)

    def clock() -> float:
        module.synchronize(device)
        return time.perf_counter()

    return clock


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def clock_for(name: str, device: torch.device) -> Callable[[], float]:
    """The clock ``name`` on ``device``: accelerators only have a synchronised wall clock."""
    if device.type == "cpu":
        return CLOCKS[name]
    if name != "wall":
        raise ValueError(f"--clock {name!r} on {device.type}: only 'wall' (synchronised) there")
    return _synced_wall_clock(device)


@torch.no_grad()
def forward_once(
    model, args: dict, variant: str, sparsity: float, clock_fn: Callable[[], float]
) -> tuple[float, list[float]]:
    """One forward under ``variant``: (total seconds, per-block seconds) on ``clock_fn``."""
    clock = BlockClock(model, clock_fn)
    boost = boost_for(model, variant, sparsity)
    try:
        start = clock_fn()
        model(**args, return_dict=False)
        total = clock_fn() - start
    finally:
        if boost is not None:
            boost.remove()
        clock.remove()
    return total, clock.times


def measure(
    model,
    frames: int,
    rounds: int,
    sparsity: float,
    variants: tuple[str, ...],
    log: Callable,
    clock: Callable[[], float] = time.process_time,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, dict[str, list[float]]]:
    """Interleaved rounds: per variant the list of totals, of per-block times and of ``rest``."""
    args = inputs(frames, device, dtype)
    samples = {v: {"total": [], "block": [], "rest": []} for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for variant in order:
            total, blocks = forward_once(model, args, variant, sparsity, clock)
            samples[variant]["total"].append(total)
            samples[variant]["block"].extend(blocks)
            samples[variant]["rest"].append(total - sum(blocks))
            log(f"round {r} {variant}: total {total:.2f} s, blocks {[round(b, 2) for b in blocks]}")
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for wan_blocks.{json,md}")
    parser.add_argument("--frames", type=int, default=21, help="latent frames (21 = 81 frames)")
    parser.add_argument("--layers", type=int, default=1, help="blocks in the model (1 or 2)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--sparsity", type=float, default=0.8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default=None,
        help="cpu (process CPU seconds; the CPU default) or wall; on cuda always a wall clock "
        "read after synchronising",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    clock_name = args.clock or ("cpu" if device.type == "cpu" else "wall")
    try:
        clock = clock_for(clock_name, device)
    except ValueError as exc:
        parser.error(str(exc))
    dtype = DTYPES[args.dtype]
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "stock" not in variants:
        parser.error(f"--variants: {args.variants!r}; use 'stock' plus any of {VARIANTS}")
    tokens = args.frames * (LATENT_HW[0] // 2) * (LATENT_HW[1] // 2)
    model = build_model(args.layers, device, dtype)
    if device.type == "cpu":
        load_cpu_kernel()  # builds the fused kernel on a machine's first run, else loads it
        # Warm-up on a 1-frame latent: first-call allocations and dispatch.
        warmup_frames = 1
    else:
        # The GPU's sparse kernel (FlexAttention) compiles once per shape: warm up at the
        # measured shape so no round pays for it.
        warmup_frames = args.frames
    measure(model, warmup_frames, 1, args.sparsity, variants, lambda _: None, clock, device, dtype)
    samples = measure(
        model,
        args.frames,
        args.rounds,
        args.sparsity,
        variants,
        lambda m: print(m, flush=True),
        clock,
        device,
        dtype,
    )
    table = BenchTable(
        f"Wan2.1-1.3B blocks, {tokens} tokens ({args.frames} x 30 x 52), {args.dtype}, "
        f"{device.type}, {args.layers} block(s) measured, 30 projected",
        [
            "variant",
            "block_s",
            "block_speedup",
            "rest_s",
            "step_30_s",
            "step_30_speedup",
            "cached_step_fraction",
        ],
        {
            "rounds": args.rounds,
            "layers": args.layers,
            "tokens": tokens,
            "sparsity": args.sparsity,
            "threads": torch.get_num_threads(),
            "clock": clock_name if device.type == "cpu" else "wall, device synchronised",
            "device": device.type,
            "dtype": args.dtype,
            "block_s": "median over rounds and blocks of one block forward",
            "rest_s": "median of (forward - its blocks): embeddings, RoPE tables, output head",
            "step_30_s": "rest_s + 30 x block_s (one transformer call of the 30-block model)",
            "cached_step_fraction": "(rest_s + block_s) / step_30_s: cost of a step the "
            "first-block cache skips, relative to a full step of the same variant",
            "samples": samples,
        },
    )
    base_block = Timing(samples["stock"]["block"]).median
    base_step = Timing(samples["stock"]["rest"]).median + WAN_BLOCKS * base_block
    for variant in variants:
        block = Timing(samples[variant]["block"]).median
        rest = Timing(samples[variant]["rest"]).median
        step = rest + WAN_BLOCKS * block
        table.add(
            variant=variant,
            block_s=block,
            block_speedup=base_block / block,
            rest_s=rest,
            step_30_s=step,
            step_30_speedup=base_step / step,
            cached_step_fraction=(rest + block) / step,
        )
    print(table.to_markdown(), flush=True)
    table.write(args.out, "wan_blocks")


if __name__ == "__main__":
    main()
