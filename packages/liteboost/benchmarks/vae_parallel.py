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

``--slab-estimate`` measures, in one process on one thread, what the spatial mode's busiest rank
computes, without running ranks: the decode of its latent row slab plus one latent halo row on
each inner side (more than the exact halo: one row at every convolution's own resolution), plus
the replicated middle block's share of the rest of the frame (``spatial_plan``'s
``replicated_share``). Halo and gather communication are left out. It stands in for the
per-rank compute on a free core where the machine has fewer free cores than ranks (4 ranks on 2
shared cores inflate every rank's CPU time by cache and scheduler contention).

    python packages/liteboost/benchmarks/vae_parallel.py --out DIR --slab-estimate [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from liteboost.parallel.vae_dp import choose_decode_mode, parallel_decode
from liteboost.parallel.vae_spatial import plan_rows, spatial_plan
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


@torch.no_grad()
def slab_estimate(shape: tuple[int, ...], worlds: list[int], rounds: int) -> BenchTable:
    """Single-thread decode of the whole latent and of each layout's busiest slab (see above)."""
    from diffusers import AutoencoderKLWan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**WAN21_VAE).eval()
    plan = spatial_plan(vae)
    if plan is None:
        raise SystemExit("the decoder has no spatial plan")
    rows = shape[3]
    z = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    slabs = {}
    for world in worlds:
        spans = plan_rows(rows, world)
        # The busiest rank: the most rows, plus a halo row on each side that has a neighbour.
        slabs[world] = max(
            (stop - start + (start > 0) + (stop < rows), max(0, start - 1), min(rows, stop + 1))
            for start, stop in spans
        )
    times: dict[str, list[float]] = {"whole": []} | {str(w): [] for w in worlds}
    for _ in range(rounds):
        for name in times:
            part = z if name == "whole" else z[..., slabs[int(name)][1] : slabs[int(name)][2], :]
            start = time.thread_time()
            vae.decode(part)
            times[name].append(time.thread_time() - start)
    whole = min(times["whole"])
    table = BenchTable(
        f"VAE spatial decode, busiest rank's compute estimated in one process, latent "
        f"{shape[2]}x{rows}x{shape[4]}, one thread",
        ["ranks", "slab_rows", "whole_s", "slab_s", "replicated_s", "rank_s", "speedup"],
        {
            "vae": WAN21_VAE,
            "rounds": rounds,
            "replicated_share": plan.replicated_share,
            "slab_s": "min over rounds: decode of the slab (rows incl. a halo row per inner side)",
            "replicated_s": "replicated_share x whole_s x (1 - slab_rows / rows): the middle "
            "block of the rest of the frame, which every rank also runs",
            "rank_s": "slab_s + replicated_s; speedup = whole_s / rank_s",
        },
    )
    for world in worlds:
        slab_rows = slabs[world][0]
        slab = min(times[str(world)])
        replicated = plan.replicated_share * whole * max(0.0, 1 - slab_rows / rows)
        table.add(
            ranks=world,
            slab_rows=slab_rows,
            whole_s=whole,
            slab_s=slab,
            replicated_s=replicated,
            rank_s=slab + replicated,
            speedup=whole / (slab + replicated),
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for vae_parallel.{json,md}")
    parser.add_argument("--latent", default="30x52", help="latent rows x columns (480p: 60x104)")
    parser.add_argument("--frames", type=int, default=1, help="latent frames")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--modes", default="spatial,temporal")
    parser.add_argument("--slab-estimate", action="store_true", help="see the module docstring")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of --slab-estimate")
    args = parser.parse_args()
    rows, cols = (int(v) for v in args.latent.split("x"))
    shape = (1, WAN21_VAE["z_dim"], args.frames, rows, cols)
    if args.slab_estimate:
        estimate = slab_estimate(shape, [int(w) for w in args.ranks.split(",")], args.rounds)
        print(estimate.to_markdown())
        estimate.write(args.out, "vae_slab_estimate")
        return
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
