"""End-to-end tiny WanPipeline: boosts on vs off, side by side in interleaved rounds.

The tiny random-weight Wan (see liteboost.tiny) at 128 x 128, 17 frames: 5 x 8 x 8 = 320
tokens. "boost" = cached RoPE and the dense backend chain; "boost + sparse 0.5" adds block-sparse
self-attention in blocks of 64. At this size attention is a small part of the step, so the ratio
mostly shows liteboost's fixed overhead; the attention and RoPE tables show the kernels.

    python packages/liteboost/benchmarks/pipeline.py --out DIR
"""

from __future__ import annotations

import argparse

import torch

import liteboost
from liteboost.tiny import build_tiny_pipeline
from npu_core.bench import BenchTable, compare

CALL = dict(
    prompt="a kite",
    height=128,
    width=128,
    num_frames=17,
    num_inference_steps=4,
    output_type="pt",
    max_sequence_length=32,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for pipeline.{json,md}")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    pipe = build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe(**CALL, generator=torch.Generator().manual_seed(0)).frames

    table = BenchTable(
        "Tiny WanPipeline end to end (CPU): liteboost on vs off",
        ["variant", "off_ms", "on_ms", "speedup", "max_abs_diff"],
        {"call": CALL, "repeats": args.repeats},
    )
    reference = run()
    for name, kwargs in [
        ("boost (sparsity 0)", {}),
        ("boost + sparse 0.5", {"sparsity": 0.5, "block_size": 64}),
    ]:
        manager = liteboost.BoostManager(pipe, **kwargs)
        boosted = run()
        manager.remove()

        def on(kwargs=kwargs):
            with liteboost.BoostManager(pipe, **kwargs):
                return run()

        result = compare(run, on, warmup=1, repeats=args.repeats)
        table.add(
            variant=name,
            off_ms=result.baseline.median * 1e3,
            on_ms=result.candidate.median * 1e3,
            speedup=result.speedup,
            max_abs_diff=(boosted - reference).abs().max().item(),
        )
    print(table.to_markdown())
    table.write(args.out, "pipeline")


if __name__ == "__main__":
    main()
