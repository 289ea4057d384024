"""VAE decode across ranks: spatial row slabs (halo exchange) and temporal spans vs one process.

A Wan2.1-VAE-shaped decoder (base 96, z 16, channel multipliers 1/2/4/4, 2 residual blocks per
level, random weights, fp32) decodes one latent clip. Every process runs one intra-op thread, so
one rank stands for one device: "single" is the whole decode on one thread, a layout with n
ranks the same decode split over n threads.

Two speed-ups are reported. ``wall`` is the barrier-to-barrier time of the busiest rank; it is
only meaningful when the machine has a free core per rank. ``cpu`` compares the decoding
thread's CPU time (``time.thread_time``: compute, not waiting): single-process CPU time over the
largest rank's CPU time. On a shared or oversubscribed machine (4 ranks on 2 cores) the CPU-time
ratio is the estimate of the speed-up with one free core per rank; it leaves out the time spent
waiting for halos and the final gather, so it is an upper bound.

    python packages/liteboost/benchmarks/vae_parallel.py --out DIR [--latent 30x52] [--frames 1]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from liteboost.parallel.vae_dp import choose_decode_mode, parallel_decode
from npu_core.bench import BenchTable
from npu_core.dist import launch

WAN21_VAE = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    temperal_downsample=[False, True, True],
)


def _timed(fn) -> tuple[torch.Tensor, float, float]:
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    out = fn()
    cpu = time.thread_time() - cpu
    dist.barrier()
    return out, time.perf_counter() - wall, cpu


@torch.no_grad()
def _rank(shape: tuple[int, ...], modes: list[str], reference: torch.Tensor | None) -> dict:
    from diffusers import AutoencoderKLWan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**WAN21_VAE).eval()
    z = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    stock = type(vae).decode.__get__(vae)
    result: dict = {"auto": choose_decode_mode(vae, z, dist.get_world_size())}
    if reference is None:
        # One rank decodes alone (the others wait at the barrier): the single-device time.
        dist.barrier()
        if dist.get_rank() == 0:
            wall, cpu = time.perf_counter(), time.thread_time()
            reference = stock(z).sample
            result["single"] = (time.perf_counter() - wall, time.thread_time() - cpu)
            result["reference"] = reference
        dist.barrier()
    for mode in modes:
        out, wall, cpu = _timed(
            lambda m=mode: parallel_decode(vae, z, lambda x: stock(x).sample, mode=m)
        )
        walls = [None] * dist.get_world_size()
        dist.all_gather_object(walls, (wall, cpu))
        diff = (out - reference).abs().max().item() if reference is not None else None
        result[mode] = {"per_rank": walls, "diff": diff}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for vae_parallel.{json,md}")
    parser.add_argument("--latent", default="30x52", help="latent rows x columns (480p: 60x104)")
    parser.add_argument("--frames", type=int, default=1, help="latent frames")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--modes", default="spatial,temporal")
    args = parser.parse_args()
    rows, cols = (int(v) for v in args.latent.split("x"))
    shape = (1, WAN21_VAE["z_dim"], args.frames, rows, cols)
    modes = args.modes.split(",")
    table = BenchTable(
        f"VAE decode, Wan2.1-VAE-shaped decoder, latent {args.frames}x{rows}x{cols}, "
        "one thread per process",
        [
            "ranks",
            "mode",
            "auto_mode",
            "single_s",
            "wall_s",
            "wall_speedup",
            "cpu_single_s",
            "cpu_max_rank_s",
            "cpu_speedup",
            "max_abs_diff",
        ],
        {"vae": WAN21_VAE, "latent_shape": shape},
    )
    single = reference = None
    for world in (int(w) for w in args.ranks.split(",")):
        res = launch(_rank, world, shape, modes, reference, timeout=3600)[0]
        if single is None:
            single, reference = res["single"], res["reference"]
        for mode in modes:
            per_rank = res[mode]["per_rank"]
            wall = max(w for w, _ in per_rank)
            cpu = max(c for _, c in per_rank)
            table.add(
                ranks=world,
                mode=mode,
                auto_mode=res["auto"],
                single_s=single[0],
                wall_s=wall,
                wall_speedup=single[0] / wall,
                cpu_single_s=single[1],
                cpu_max_rank_s=cpu,
                cpu_speedup=single[1] / cpu,
                max_abs_diff=res[mode]["diff"],
            )
    print(table.to_markdown())
    table.write(args.out, "vae_parallel")


if __name__ == "__main__":
    main()
