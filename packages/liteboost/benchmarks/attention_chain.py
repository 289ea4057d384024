"""The dense attention chain's choice against forced SDPA, at Wan self-attention shapes.

The chain (``liteboost.attention.backends``) picks the first installed kernel that takes the
call (FA3 on Hopper, FA2 on Ampere, SDPA otherwise); this times what it picked against stock
SDPA on the same q, k and v, and reports which backend ran. On a CPU both sides are SDPA in
fp32, so the ratio there only shows the chain's dispatch overhead, at one latent frame of
30 x 52 tokens; on a GPU the default is Wan2.1 1.3B's 81-frame 480p clip (21 frames, 32760
tokens) in bf16.

    python packages/liteboost/benchmarks/attention_chain.py --out DIR
    python packages/liteboost/benchmarks/attention_chain.py --out DIR --device cuda --frames 21
"""

from __future__ import annotations

import argparse

import torch

from liteboost.attention import backends
from liteboost.attention.backends import AttentionCall, select_backend
from npu_core.bench import BenchTable, compare

HEIGHT, WIDTH = 30, 52
"""Latent tokens per frame at 480p after Wan's 2 x 2 patching."""
HEADS, HEAD_DIM = 12, 128
"""Wan2.1 1.3B."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for attention_chain.{json,md}")
    parser.add_argument("--frames", type=int, help="latent frames (default: 1 on cpu, 21 on cuda)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    frames = args.frames if args.frames is not None else (21 if device.type == "cuda" else 1)
    if frames < 1 or args.repeats < 1:
        parser.error("--frames and --repeats must be >= 1")
    seq = frames * HEIGHT * WIDTH
    # bf16 GEMMs are emulated on CPUs without native bf16: minutes per call, nothing learnt
    dtypes = (torch.bfloat16,) if device.type == "cuda" else (torch.float32,)
    table = BenchTable(
        f"Attention chain vs forced SDPA, Wan self-attention ({device.type})",
        ["dtype", "tokens", "chain_backend", "sdpa_ms", "chain_ms", "speedup"],
        {"heads": HEADS, "head_dim": HEAD_DIM, "repeats": args.repeats, "device": device.type},
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        # [B, S, N, D], the layout Wan and FlashAttention use
        q, k, v = (
            torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen).to(device, dtype) for _ in range(3)
        )
        chosen = select_backend(AttentionCall.of(q, k, v))
        timing = compare(
            lambda q=q, k=k, v=v: backends.flash_attention(q, k, v, backend="sdpa"),
            lambda q=q, k=k, v=v: backends.flash_attention(q, k, v),
            warmup=1,
            repeats=args.repeats,
            sync=sync,
        )
        table.add(
            dtype=str(dtype).removeprefix("torch."),
            tokens=seq,
            chain_backend=chosen.value,
            sdpa_ms=timing.baseline.median * 1e3,
            chain_ms=timing.candidate.median * 1e3,
            speedup=timing.speedup,
        )
    print(table.to_markdown())
    table.write(args.out, "attention_chain")


if __name__ == "__main__":
    main()
