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
        ulysses_degree: ranks sharing one sequence (== world_size or 1).
        vae_parallel: split VAE decode over time across the ranks.
        pad_heads: allow head counts not divisible by the degree by padding zero heads.
        group: the Ulysses process group (None = default group).
        group_for_vae: the VAE process group (None = default group).
        vae_receptive_field: override of the computed causal overlap (None = exact).
    """

    world_size: int
    ulysses_degree: int
    vae_parallel: bool
    pad_heads: bool = True
    group: object | None = None
    group_for_vae: object | None = None
    vae_receptive_field: int | None = None


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _resolve_degree(ulysses_degree: int | None, world: int) -> int:
    degree = world if ulysses_degree is None else ulysses_degree
    if degree not in (1, world):
        raise ValueError(
            f"ulysses_degree={ulysses_degree} with world size {world}: use 1 (no sequence "
            f"parallelism) or {world} (all ranks share each sequence)"
        )
    return degree


class ParallelManager:
    """Applies Ulysses sequence parallelism and VAE temporal parallelism in place.

    Call it on every rank, after ``torch.distributed`` is initialised (npu-core's launcher and
    torchrun both do that), with identical inputs and seeds on every rank (see :meth:`sync_seed`).
    Every rank ends with the full output. Without a process group it changes nothing.

    Args:
        model_or_pipeline: a supported model (``liteboost.supported_parallel()``) or a pipeline.
        ulysses_degree: ranks per sequence: None = the world size, 1 = off.
        vae_parallel: decode the video with one span of frames per rank.
        pad_heads: allow ``heads % degree != 0`` (zero heads); False refuses such degrees with an
            error listing the degrees that work.
        vae_receptive_field: latent-frame overlap between VAE spans; None = the exact causal
            receptive field (bit-identical output). Smaller values trade exactness for speed.

    Raises:
        UnsupportedModelError: nothing in ``model_or_pipeline`` is supported; lists what is.
        ValueError: an unusable ``ulysses_degree``.
    """

    def __init__(
        self,
        model_or_pipeline: object,
        ulysses_degree: int | None = None,
        vae_parallel: bool = True,
        *,
        pad_heads: bool = True,
        vae_receptive_field: int | None = None,
    ) -> None:
        world = _world_size()
        self.config = ParallelConfig(
            world_size=world,
            ulysses_degree=_resolve_degree(ulysses_degree, world),
            vae_parallel=vae_parallel,
            pad_heads=pad_heads,
            vae_receptive_field=vae_receptive_field,
        )
        self.handles: dict[str, Handle] = {}
        targets = [(name, m, find_parallel(m)) for name, m in components(model_or_pipeline)]
        targets = [(name, m, plan) for name, m, plan in targets if plan is not None]
        if not targets:
            raise unsupported(model_or_pipeline, "parallel", supported_parallel())
        for name, module, plan in targets:
            handle = plan(module, self.config)
            if handle is not None:
                self.handles[name] = handle

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
