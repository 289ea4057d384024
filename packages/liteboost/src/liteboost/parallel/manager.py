"""ParallelManager: turn a model or pipeline into its multi-rank form in place.

The user's settings are a :class:`liteboost.parallel.config.ParallelConfig`; the mesh and the
process groups built from them are a :class:`ParallelRuntime`, which the parallel plans receive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from liteboost._components import components
from liteboost.models.registry import Handle, find_parallel, supported_parallel, unsupported
from liteboost.parallel.config import ParallelConfig


@dataclass(frozen=True)
class ParallelRuntime:
    """What the parallel plans receive: the resolved settings and this rank's process groups.

    Attributes:
        config: the settings, ``ulysses_degree`` resolved for the world size.
        world_size: ranks in the default process group (1 without one).
        mesh: the named DeviceMesh ("cfg", "ring", "ulysses"); None on one rank.
        ulysses_group: this rank's Ulysses group.
        ring_group: this rank's ring.
        cfg_group: ranks holding the same sequence shard of the two CFG branches.
        sp_group: every rank sharing this rank's sequence (ring x ulysses).
        pipeline: the pipeline the manager was given (CFG parallel reads whether guidance is
            on); None for a bare model.
    """

    config: ParallelConfig
    world_size: int
    mesh: object | None = None
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    cfg_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None
    pipeline: object | None = None


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _device_type() -> str:
    backend = str(dist.get_backend()).lower()
    return {"nccl": "cuda", "hccl": "npu"}.get(backend, "cpu")


def _build_mesh(cfg: int, ulysses: int, ring: int) -> dict[str, Any]:
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
        "ulysses_group": mesh.get_group("ulysses"),
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

    Attributes:
        config: the validated settings, ``ulysses_degree`` resolved for the world size.
        runtime: the settings plus the mesh and this rank's process groups.

    Raises:
        UnsupportedModelError: nothing in ``model_or_pipeline`` is supported; lists what is.
        npu_core.config.ConfigError: (a ValueError) a setting out of range, naming the field,
            the value and what is allowed.
        ValueError: degrees whose product is not the world size (the message names them and
            the world size), or ``cfg_degree=2`` without a pipeline.
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
        settings = ParallelConfig.validate_tree(
            {
                "cfg_degree": cfg_degree,
                "ulysses_degree": ulysses_degree,
                "ring_degree": ring_degree,
                "vae_parallel": vae_parallel,
                "pad_heads": pad_heads,
                "vae_receptive_field": vae_receptive_field,
                "vae_mode": vae_mode,
            }
        )
        world = _world_size()
        self.config = settings.resolve(world)
        cfg, ring = self.config.cfg_degree, self.config.ring_degree
        ulysses = settings.ulysses_for(world)
        is_module = isinstance(model_or_pipeline, torch.nn.Module)
        if cfg > 1 and is_module:
            raise ValueError(
                f"cfg_degree={cfg} needs the pipeline, not a bare "
                f"{type(model_or_pipeline).__name__}: the ranks must know whether the pipeline "
                "runs the unconditional branch at each step"
            )
        groups = _build_mesh(cfg, ulysses, ring) if world > 1 else {}
        self.runtime = ParallelRuntime(
            self.config,
            world,
            pipeline=None if is_module else model_or_pipeline,
            **groups,
        )
        self.handles: dict[str, Handle] = {}
        found = [(name, m, find_parallel(m)) for name, m in components(model_or_pipeline)]
        targets = [(name, m, plan) for name, m, plan in found if plan is not None]
        if not targets:
            raise unsupported(model_or_pipeline, "parallel", supported_parallel())
        try:
            for name, module, plan in targets:
                handle = plan(module, self.runtime)
                if handle is not None:
                    self.handles[name] = handle
        except BaseException:
            self.remove()
            raise

    @property
    def mesh(self) -> object | None:
        """The named DeviceMesh ("cfg", "ring", "ulysses"), None on a single process."""
        return self.runtime.mesh

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
