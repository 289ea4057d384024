"""ParallelManager: turn a model or pipeline into its multi-rank form in place."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from liteboost._components import components
from liteboost.models.registry import Handle, find_parallel, supported_parallel, unsupported


@dataclass(frozen=True)
class ParallelConfig:
    """Resolved multi-rank settings.

    Attributes:
        world_size: ranks in the default process group (1 without one).
        ulysses_degree: ranks sharing one sequence through Ulysses all-to-alls (heads split).
        vae_parallel: split VAE decode / encode across the ranks.
        pad_heads: allow head counts not divisible by the degree by padding zero heads.
        group: the Ulysses process group (None = default group when it spans every rank).
        group_for_vae: the VAE process group (None = default group).
        vae_receptive_field: override of the computed causal overlap (None = exact).
        cfg_degree: 1, or 2 to run the conditional and unconditional branches on different ranks.
        ring_degree: ranks sharing one sequence through ring attention (K/V passed around).
        mesh: the named DeviceMesh ("cfg", "ring", "ulysses"); None on one rank.
        cfg_group: ranks holding the same sequence shard of the two CFG branches.
        ring_group: this rank's ring.
        sp_group: every rank sharing this rank's sequence (ring x ulysses).
        pipeline: the pipeline the manager was given (CFG parallel reads whether guidance is on).
        vae_mode: VAE decode split: "temporal", "spatial" or None (by shape).
    """

    world_size: int
    ulysses_degree: int
    vae_parallel: bool
    pad_heads: bool = True
    group: dist.ProcessGroup | None = None
    group_for_vae: dist.ProcessGroup | None = None
    vae_receptive_field: int | None = None
    cfg_degree: int = 1
    ring_degree: int = 1
    mesh: object | None = None
    cfg_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None
    pipeline: object | None = None
    vae_mode: str | None = None

    @property
    def sequence_degree(self) -> int:
        """Ranks sharing one sequence: ``ring_degree * ulysses_degree``."""
        return self.ring_degree * self.ulysses_degree


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return value


def resolve_degrees(
    world: int, cfg_degree: int, ulysses_degree: int | None, ring_degree: int
) -> tuple[int, int, int]:
    """``(cfg, ulysses, ring)`` with product ``world``; ``ulysses_degree=None`` takes the rest.

    Raises:
        ValueError: a degree below 1, ``cfg_degree`` other than 1 or 2, or a product that is not
            the world size (the message names every degree and the world size).
    """
    cfg = _check_degree("cfg_degree", cfg_degree)
    ring = _check_degree("ring_degree", ring_degree)
    if cfg > 2:
        raise ValueError(
            f"cfg_degree={cfg}: use 1 or 2 (two branches: conditional and unconditional)"
        )
    if ulysses_degree is None:
        if world % (cfg * ring):
            raise ValueError(
                f"cfg_degree={cfg} x ring_degree={ring} does not divide the world size {world}"
            )
        ulysses = world // (cfg * ring)
    else:
        ulysses = _check_degree("ulysses_degree", ulysses_degree)
    if cfg * ulysses * ring != world:
        raise ValueError(
            f"cfg_degree={cfg} x ulysses_degree={ulysses} x ring_degree={ring} = "
            f"{cfg * ulysses * ring}, but the world size is {world}: the product must equal it"
        )
    return cfg, ulysses, ring


def _device_type() -> str:
    backend = str(dist.get_backend()).lower()
    return {"nccl": "cuda", "hccl": "npu"}.get(backend, "cpu")


def _build_mesh(cfg: int, ulysses: int, ring: int) -> dict:
    """The named mesh ("cfg", "ring", "ulysses"; Ulysses innermost) and this rank's groups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        _device_type(), (cfg, ring, ulysses), mesh_dim_names=("cfg", "ring", "ulysses")
    )
    # The (ring, ulysses) sub-mesh as one group, built directly: DeviceMesh's private
    # ``_flatten`` took 20 s on gloo here. Every rank creates every group, in the same order.
    sp = ring * ulysses
    rank = dist.get_rank()
    sp_group = None
    for branch in range(cfg):
        group = dist.new_group(list(range(branch * sp, (branch + 1) * sp)))
        if branch == rank // sp:
            sp_group = group
    return {
        "mesh": mesh,
        "cfg_group": mesh.get_group("cfg"),
        "ring_group": mesh.get_group("ring"),
        "group": mesh.get_group("ulysses"),
        "sp_group": sp_group,
    }


class ParallelManager:
    """Applies hybrid CFG x Ring x Ulysses parallelism and VAE parallelism in place.

    Call it on every rank, after ``torch.distributed`` is initialised (npu-core's launcher and
    torchrun both do that), with identical inputs and seeds on every rank (see :meth:`sync_seed`).
    Every rank ends with the full output. Without a process group it changes nothing.

    The ranks form a named DeviceMesh ``("cfg", "ring", "ulysses")``, Ulysses innermost:
    ``cfg_degree`` branches x ``ring_degree`` ring positions x ``ulysses_degree`` Ulysses ranks,
    whose product must be the world size. CFG parallel runs the conditional and unconditional
    transformer calls of a step on different ranks and exchanges the two outputs once per step;
    Ulysses splits heads through all-to-alls; ring attention passes K/V chunks around the ring.
    Block-sparse attention needs the whole sequence on a rank, so it combines with Ulysses and
    CFG but not with a ring (refused with an error).

    Args:
        model_or_pipeline: a supported model (``liteboost.supported_parallel()``) or a pipeline.
            CFG parallel needs the pipeline: it reads whether guidance is on at each step.
        ulysses_degree: Ulysses ranks per sequence; None = world size / (cfg x ring), 1 = off.
        vae_parallel: decode (and encode) the video across all ranks: spatial row slabs or
            temporal spans, whichever does less work for the shape (see ``vae_mode``).
        pad_heads: allow ``heads % ulysses_degree != 0`` (zero heads); False refuses such
            degrees with an error listing the degrees that work.
        vae_receptive_field: latent-frame overlap between temporal VAE spans; None = the exact
            causal receptive field (bit-identical output). Smaller values trade exactness for
            speed.
        cfg_degree: 1, or 2 for CFG parallel.
        ring_degree: ring-attention ranks per sequence; 1 = off.
        vae_mode: "temporal" (spans of frames, bit-identical to stock), "spatial" (row slabs
            with halo exchange, equal to float rounding) or None to pick by shape. Encode is
            always temporal.

    Raises:
        UnsupportedModelError: nothing in ``model_or_pipeline`` is supported; lists what is.
        ValueError: unusable degrees (the message names them and the world size), or
            ``cfg_degree=2`` without a pipeline.
    """

    def __init__(
        self,
        model_or_pipeline: object,
        ulysses_degree: int | None = None,
        vae_parallel: bool = True,
        *,
        pad_heads: bool = True,
        vae_receptive_field: int | None = None,
        cfg_degree: int = 1,
        ring_degree: int = 1,
        vae_mode: str | None = None,
    ) -> None:
        if vae_mode not in (None, "temporal", "spatial"):
            raise ValueError(f"vae_mode={vae_mode!r}; use 'temporal', 'spatial' or None (by shape)")
        world = _world_size()
        cfg, ulysses, ring = resolve_degrees(world, cfg_degree, ulysses_degree, ring_degree)
        is_module = isinstance(model_or_pipeline, torch.nn.Module)
        if cfg > 1 and is_module:
            raise ValueError(
                f"cfg_degree={cfg} needs the pipeline, not a bare "
                f"{type(model_or_pipeline).__name__}: the ranks must know whether the pipeline "
                "runs the unconditional branch at each step"
            )
        groups = _build_mesh(cfg, ulysses, ring) if world > 1 else {}
        self.config = ParallelConfig(
            world_size=world,
            ulysses_degree=ulysses,
            vae_parallel=vae_parallel,
            pad_heads=pad_heads,
            vae_receptive_field=vae_receptive_field,
            cfg_degree=cfg,
            ring_degree=ring,
            pipeline=None if is_module else model_or_pipeline,
            vae_mode=vae_mode,
            **groups,
        )
        self.handles: dict[str, Handle] = {}
        found = [(name, m, find_parallel(m)) for name, m in components(model_or_pipeline)]
        targets = [(name, m, plan) for name, m, plan in found if plan is not None]
        if not targets:
            raise unsupported(model_or_pipeline, "parallel", supported_parallel())
        try:
            for name, module, plan in targets:
                handle = plan(module, self.config)
                if handle is not None:
                    self.handles[name] = handle
        except BaseException:
            self.remove()
            raise

    @property
    def mesh(self) -> object | None:
        """The named DeviceMesh ("cfg", "ring", "ulysses"), None on a single process."""
        return self.config.mesh

    @property
    def parallelized(self) -> list[str]:
        """Names of the components now running on several ranks."""
        return list(self.handles)

    @staticmethod
    def sync_seed(seed: int | None = None) -> int:
        """Make every rank use rank 0's seed (``seed`` or a fresh one); seeds torch; returns it.

        Ulysses shards one shared sequence: ranks drawing different initial noise would
        silently produce garbage, so seed through this before sampling.
        """
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        if _world_size() > 1:
            box = torch.tensor([seed], dtype=torch.int64)
            dist.broadcast(box, src=0)
            seed = int(box.item())
        torch.manual_seed(seed)
        return seed

    def remove(self) -> None:
        """Return every component to its single-process form."""
        while self.handles:
            _, handle = self.handles.popitem()
            handle.remove()

    def __enter__(self) -> ParallelManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
