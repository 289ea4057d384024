"""Find the models inside a diffusers pipeline (or accept a bare model)."""

from __future__ import annotations

import torch


def components(model_or_pipeline: object) -> list[tuple[str, torch.nn.Module]]:
    """``[(name, module)]``: the pipeline's nn.Module components, or ``[("model", model)]``."""
    if isinstance(model_or_pipeline, torch.nn.Module):
        return [("model", model_or_pipeline)]
    table = getattr(model_or_pipeline, "components", None)
    if not isinstance(table, dict):
        raise TypeError(
            "expected a torch.nn.Module or a diffusers pipeline, "
            f"got {type(model_or_pipeline).__name__}"
        )
    return [(name, m) for name, m in table.items() if isinstance(m, torch.nn.Module)]
