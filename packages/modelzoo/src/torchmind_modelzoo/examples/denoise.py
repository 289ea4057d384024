"""Diffusion example: flow-matching Euler sampling of a latent with the card's denoiser.

Only the denoiser runs (text encoders and VAEs are the pipelines' business and are replaced by
fixed random conditioning), which is what conversion exports and what dominates serving time.
"""

from __future__ import annotations

from typing import Any

import torch

from torchmind_modelzoo.examples.base import Example, model_config, model_dtype
from torchmind_modelzoo.examples.denoise_inputs import builder_for


class Denoise(Example):
    """``steps`` Euler steps of FlowMatchEulerDiscreteScheduler on one latent."""

    def _build(self, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], Any]:
        return builder_for(self.card.architecture)(
            model_config(model), self.cfg, model_dtype(model)
        )

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        inputs, spec = self._build(model)
        if spec.cond is not None:
            latent = inputs["hidden_states"]
            inputs["hidden_states"] = torch.cat([latent, spec.cond], dim=spec.cond_dim)
        return inputs

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs, return_dict=False)[0]

    @torch.inference_mode()
    def run(
        self, model: torch.nn.Module, *, second: torch.nn.Module | None = None, **_: Any
    ) -> dict[str, Any]:
        """Sample; ``second`` is the low-noise expert of a two-expert card (Wan2.2 A14B)."""
        # From its own module: diffusers' package __init__ gives type checkers the dummy class.
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
            FlowMatchEulerDiscreteScheduler,
        )

        inputs, spec = self._build(model)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        scheduler.set_timesteps(self.cfg.steps)
        boundary = self.cfg.expert_boundary
        latent = inputs.pop("hidden_states")
        inputs.pop("timestep")
        start = latent.clone()
        used = []
        for t in scheduler.timesteps:
            denoiser = model
            if boundary is not None and second is not None and t < boundary * 1000:
                denoiser = second
            used.append("low" if denoiser is second else "high")
            hidden = latent if spec.cond is None else torch.cat([latent, spec.cond], spec.cond_dim)
            step = {"timestep": t.reshape(1).to(latent.dtype) * spec.timestep_scale}
            pred = self.forward(denoiser, **inputs, **step, hidden_states=hidden)
            latent = scheduler.step(pred, t, latent, return_dict=False)[0]
        return {
            "latent_shape": list(latent.shape),
            "steps": len(scheduler.timesteps),
            "experts": used,
            "finite": bool(torch.isfinite(latent).all()),
            "latent_std": round(float(latent.float().std()), 6),
            "moved": round(float((latent - start).float().abs().mean()), 6),
        }
