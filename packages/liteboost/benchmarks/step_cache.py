"""Step caching (diffusers' cache hooks through BoostManager(cache=...)): speed and error.

A tiny-pipeline Wan with a larger random transformer (4 blocks, 4 heads x 32, FFN 256) denoises
640 tokens (17 frames at 128 x 256) in 10 steps with CFG. Each variant's final latent is compared
with the uncached one (relative L2 error) and timed by the CPU time of the one compute thread
(``time.thread_time``), which a loaded machine does not inflate the way it inflates wall time.
``block runs`` counts forwards of the last block (each step runs it once per CFG branch unless
the cache skips it).

Random weights change more between steps than a trained model does, so the first-block cache
skips fewer steps here than on a real checkpoint at the same threshold: read the error/speed
trade-off, not the absolute skip rate.

    python packages/liteboost/benchmarks/step_cache.py --out DIR
"""

from __future__ import annotations

import argparse
import time

import torch

import liteboost
from liteboost.tiny import build_tiny_pipeline, build_tiny_transformer
from npu_core.bench import BenchTable

TRANSFORMER = dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=256, num_layers=4)
CALL = dict(
    prompt="a red kite over a beach",
    negative_prompt="blurry",
    height=128,
    width=256,
    num_frames=17,
    num_inference_steps=10,
    guidance_scale=5.0,
    output_type="latent",
)
VARIANTS = {
    "none": {},
    "first_block 0.05": {"cache": "first_block", "cache_threshold": 0.05},
    "first_block 0.2": {"cache": "first_block", "cache_threshold": 0.2},
    "pab": {"cache": "pab"},
    "taylorseer": {"cache": "taylorseer"},
    "faster": {"cache": "faster"},
    "sparse 0.5": {"sparsity": 0.5, "block_size": 64},
    "sparse 0.5 + first_block 0.2": {
        "sparsity": 0.5,
        "block_size": 64,
        "cache": "first_block",
        "cache_threshold": 0.2,
    },
}


@torch.no_grad()
def _run(pipe, boost: dict) -> tuple[torch.Tensor, float, int]:
    runs = []
    handle = pipe.transformer.blocks[-1].ffn.register_forward_hook(lambda *_: runs.append(1))
    with liteboost.BoostManager(pipe, **boost):
        cpu = time.thread_time()
        latents = pipe(**CALL, generator=torch.Generator().manual_seed(0)).frames
        cpu = time.thread_time() - cpu
    handle.remove()
    return latents, cpu, len(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for step_cache.{json,md}")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = build_tiny_pipeline()
    pipe.transformer = build_tiny_transformer(**TRANSFORMER)
    pipe.set_progress_bar_config(disable=True)
    results: dict = {}
    for _ in range(args.rounds):  # interleaved rounds
        for name, boost in VARIANTS.items():
            latents, cpu, runs = _run(pipe, boost)
            entry = results.setdefault(name, {"cpu": [], "latents": latents, "runs": runs})
            entry["cpu"].append(cpu)
    reference = results["none"]["latents"]
    base = min(results["none"]["cpu"])
    table = BenchTable(
        "Step caching on a 640-token Wan, 10 steps with CFG, one thread",
        ["variant", "cpu_s", "speedup", "block_runs", "rel_error_vs_uncached"],
        {"transformer": TRANSFORMER, "call": CALL, "rounds": args.rounds, "cpu": "min"},
    )
    for name, entry in results.items():
        cpu = min(entry["cpu"])
        rel = ((entry["latents"] - reference).norm() / reference.norm()).item()
        table.add(
            variant=name,
            cpu_s=cpu,
            speedup=base / cpu,
            block_runs=entry["runs"],
            rel_error_vs_uncached=rel,
        )
    print(table.to_markdown())
    table.write(args.out, "step_cache")


if __name__ == "__main__":
    main()
