"""The planner's tables: memory per rank (each pipeline rank's worst rank, and the worst of all),
collectives per step by mesh dimension, Newton-Schulz balance under three schemes, step time."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from hyperparallel.plan.inventory import mesh_coords
from hyperparallel.plan.planner import Plan


def size(nbytes: float) -> str:
    """Bytes in binary units, three significant digits (``1.50 GiB``)."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"


def flops(value: float) -> str:
    """FLOPs with an SI prefix (``12.3 TFLOP``)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}FLOP"
    return f"{value:.0f} FLOP"


def seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def header(plan: Plan) -> str:
    """One line naming the model, layout, batch and policy of the plan."""
    inv, cfg = plan.inventory, plan.cfg
    params = sum(p.numel for p in inv.params)
    policies = sorted(set(inv.block_policies))
    return (
        f"{inv.model}: {params / 1e9:.3g} B parameters, {inv.n_layers} blocks; world "
        f"{inv.dims.world_size}, --mesh {inv.dims.spec()}; {inv.local_batch} x {inv.seq_len} "
        f"tokens per data-parallel rank per step ({inv.microbatches} micro-batches); "
        f"activation {', '.join(policies)}"
        + (", swap_inputs" if cfg.activation.swap_inputs else "")
    )


def memory_table(plan: Plan) -> Table:
    """Per-rank bytes of each pipeline rank's worst rank; the worst rank of all is marked."""
    table = Table(
        title="Memory per rank: each pipeline rank's highest peak (* the worst rank); saved "
        "activations (act.) of the whole step by placement, and those held at once"
    )
    for column in (
        "rank",
        "pp",
        "params",
        "grads",
        "optimizer",
        "act. device",
        "act. host",
        "act. recomputed",
        "act. at peak",
        "transient",
        "peak",
    ):
        table.add_column(column, justify="right")
    worst = plan.worst.rank
    for rank in plan.ranks:
        m = plan.memory[rank]
        a = m.activations
        table.add_row(
            f"{rank}{' *' if rank == worst else ''}",
            str(mesh_coords(plan.inventory.dims, rank)["pp"]),
            size(m.params),
            size(m.grads),
            size(m.optimizer),
            size(a.device),
            size(a.host),
            size(a.recomputed),
            size(m.activations_peak.device),
            size(m.transient),
            size(m.peak),
        )
    return table


def collectives_table(plan: Plan, rank: int) -> Table:
    """What ``rank`` passes to each kind of collective per step, by source and mesh dimension."""
    table = Table(title=f"Collectives per step on rank {rank} (bytes this rank passes in)")
    for column in ("source", "kind", "mesh dim", "calls", "bytes"):
        table.add_column(
            column, justify="left" if column in ("source", "kind", "mesh dim") else "right"
        )
    for c in sorted(plan.collectives.get(rank, []), key=lambda c: (c.source, c.dim, c.kind)):
        table.add_row(
            c.source,
            c.kind,
            c.dim,
            str(c.calls),
            size(c.bytes) + (" (even share)" if c.balanced else ""),
        )
    return table


def ns_table(plan: Plan) -> Table:
    """Newton-Schulz per rank under each scheme: the most-loaded rank, the mean, their ratio,
    and the work done over all ranks per unit of work the step needs."""
    table = Table(title="Newton-Schulz per rank and step")
    for column in ("scheme", "max", "mean", "max / mean", "total / needed", "matrices (max)"):
        table.add_column(column, justify="right")
    for scheme, work in plan.ns.items():
        table.add_row(
            scheme,
            flops(work.max_flops),
            flops(work.mean_flops),
            f"{work.balance:.3f}",
            f"{work.redundancy:.3g}",
            str(max(work.matrices, default=0)),
        )
    return table


def estimate_table(plan: Plan) -> Table:
    """Step time of each representative rank, by part (see :mod:`~hyperparallel.plan.estimate`)."""
    name = plan.profile.name if plan.profile is not None else "no device"
    table = Table(title=f"Step-time estimate on {name}")
    for column in (
        "rank",
        "compute",
        "FSDP comm (overlapped)",
        "exposed comm",
        "bubble",
        "optimizer",
        "step",
    ):
        table.add_column(column, justify="right")
    for rank, e in sorted(plan.estimates.items()):
        table.add_row(
            str(rank),
            seconds(e.compute),
            seconds(e.overlapped_comm),
            seconds(e.exposed_comm),
            seconds(e.bubble),
            seconds(e.optimizer),
            seconds(e.total),
        )
    return table


def print_plan(plan: Plan, console: Console) -> None:
    """Every table of ``plan``."""
    console.print(header(plan))
    console.print(memory_table(plan))
    console.print(collectives_table(plan, plan.worst.rank))
    console.print(ns_table(plan))
    if plan.estimates:
        console.print(estimate_table(plan))
