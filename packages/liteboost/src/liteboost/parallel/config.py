"""ParallelManager's settings: the CFG x Ring x Ulysses degrees and the VAE split, validated.

Ranges are pydantic field constraints (``npu_core.config.StrictConfig``), so a bad value is one
error line naming the field, the value and what is allowed. What needs the world size (the
degrees must multiply to it) is :meth:`ParallelConfig.resolve`; process groups and the mesh are
run-time state, kept apart in ``liteboost.parallel.manager.ParallelRuntime``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from npu_core.config import StrictConfig


class ParallelConfig(StrictConfig):
    """Multi-rank settings; each field is a ``ParallelManager`` argument of the same name."""

    cfg_degree: int = Field(
        1,
        ge=1,
        le=2,
        description="1, or 2 to run the conditional and unconditional branches on different "
        "ranks (two branches: conditional and unconditional).",
    )
    ulysses_degree: int | None = Field(
        None,
        ge=1,
        description="Ranks sharing one sequence through Ulysses all-to-alls (heads split); "
        "None = the world size left after cfg_degree x ring_degree; 1 = off.",
    )
    ring_degree: int = Field(
        1,
        ge=1,
        description="Ranks sharing one sequence through ring attention (K/V passed around); "
        "1 = off.",
    )
    vae_parallel: bool = Field(True, description="Split VAE decode and encode across the ranks.")
    pad_heads: bool = Field(
        True,
        description="Allow head counts not divisible by the Ulysses degree by padding zero "
        "heads; False refuses such degrees, listing the ones that work.",
    )
    vae_receptive_field: int | None = Field(
        None,
        ge=0,
        description="Latent-frame overlap between temporal VAE spans; None = the exact causal "
        "receptive field (bit-identical output); smaller trades exactness for speed.",
    )
    vae_mode: Literal["temporal", "spatial"] | None = Field(
        None,
        description="VAE decode split: temporal (spans of frames, bit-identical to stock), "
        "spatial (row slabs with halo exchange, equal to float rounding); None = by shape.",
    )

    def ulysses_for(self, world: int) -> int:
        """The Ulysses degree on ``world`` ranks: ``ulysses_degree``, or the ranks left over.

        Raises:
            ValueError: the degrees do not multiply to ``world``; the message names every
                degree and the world size.
        """
        cfg, ring, ulysses = self.cfg_degree, self.ring_degree, self.ulysses_degree
        if ulysses is None:
            if world % (cfg * ring):
                raise ValueError(
                    f"cfg_degree={cfg} x ring_degree={ring} does not divide the world size {world}"
                )
            ulysses = world // (cfg * ring)
        if cfg * ulysses * ring != world:
            raise ValueError(
                f"cfg_degree={cfg} x ulysses_degree={ulysses} x ring_degree={ring} = "
                f"{cfg * ulysses * ring}, but the world size is {world}: the product must equal it"
            )
        return ulysses

    def resolve(self, world: int) -> ParallelConfig:
        """This config for ``world`` ranks, with ``ulysses_degree`` filled in (see
        :meth:`ulysses_for`, which raises when the degrees do not fit)."""
        return self.model_copy(update={"ulysses_degree": self.ulysses_for(world)})


def resolve_degrees(
    world: int, cfg_degree: int, ulysses_degree: int | None, ring_degree: int
) -> tuple[int, int, int]:
    """``(cfg, ulysses, ring)`` with product ``world``; ``ulysses_degree=None`` takes the rest.

    Raises:
        npu_core.config.ConfigError: (a ValueError) a degree below 1 or ``cfg_degree`` above 2,
            naming the field, the value and the bound.
        ValueError: a product that is not the world size (the message names every degree and
            the world size).
    """
    config = ParallelConfig.validate_tree(
        {"cfg_degree": cfg_degree, "ulysses_degree": ulysses_degree, "ring_degree": ring_degree}
    )
    return config.cfg_degree, config.ulysses_for(world), config.ring_degree
