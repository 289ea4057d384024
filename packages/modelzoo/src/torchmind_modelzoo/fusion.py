"""Apply a card's mfusion options: compile with Inductor + mfusion, record what mfusion did.

A card says which ops are worth fusing (``fused_ops``) and may carry explicit mfusion settings
(``convert.mfusion``, keyword options of ``mfusion.MFusionConfig``). Both become one set of
options for ``mfusion.compile_options``, scoped to the one compiled model (the global Inductor
config is left alone). What mfusion did is read back from its report; its pass ``uuid`` names
the exact settings and machine profile the graphs were compiled for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchmind_modelzoo.checks import InputError
from torchmind_modelzoo.schema import ModelCard

FUSED_OP_PASSES = {
    "rms_norm": "rmsnorm",
    "add_rms_norm": "add_rmsnorm",
    "layer_norm": "layernorm",
    "rope": "rope",
    "gelu": "gelu",
    "swiglu": "swiglu",
}
"""Card ``fused_ops`` names -> mfusion pass names (``mfusion.PASS_REGISTRY``)."""


def mfusion_options(card: ModelCard) -> dict[str, Any]:
    """The card's mfusion settings: ``convert.mfusion``, with ``passes`` from ``fused_ops``
    when it does not name them.

    Passes keep mfusion's registry order (``add_rmsnorm`` must run before ``rmsnorm``, which
    would otherwise take the norm out of the residual pattern).
    """
    options = dict(card.convert.mfusion) if card.convert else {}
    if "passes" not in options and card.fused_ops:
        from mfusion import PASS_REGISTRY

        wanted = {FUSED_OP_PASSES[op] for op in card.fused_ops if op in FUSED_OP_PASSES}
        options["passes"] = [name for name in PASS_REGISTRY if name in wanted]
    return options


class MFusionApplied:
    """Inductor options for one card, and afterwards what mfusion did with them."""

    def __init__(self, card: ModelCard) -> None:
        import mfusion

        self.card = card
        self.options = mfusion_options(card)
        try:
            self.inductor_options = mfusion.compile_options(**self.options)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{card.id}: convert.mfusion {self.options}: {exc}") from None
        self.uuid: str = self.inductor_options["post_grad_custom_post_pass"].uuid()
        self._first_graph = len(mfusion.report())

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.compile(fn)`` with Inductor and this card's mfusion options."""
        import torch

        return torch.compile(fn, options=self.inductor_options)

    def compile_module(self, module: Any) -> None:
        """Compile ``module``'s forward in place (``nn.Module.compile``): callers keep the
        module object, its attributes and submodules, so examples run unchanged."""
        module.compile(options=self.inductor_options)

    def summary(self) -> dict[str, Any]:
        """Options, uuid, and per pass the rewrites in the graphs compiled since creation.

        Graphs served from Inductor's FX graph cache did not run the passes and have no
        report entry; ``graphs`` counts only those compiled here.
        """
        import mfusion

        graphs = mfusion.report().graphs[self._first_graph :]
        rewritten: dict[str, int] = {}
        for graph in graphs:
            for decision in graph.decisions:
                if decision.rewritten:
                    rewritten[decision.pass_name] = rewritten.get(decision.pass_name, 0) + 1
        return {
            "applied": True,
            "options": self.options,
            "uuid": self.uuid,
            "graphs": len(graphs),
            "rewritten": rewritten,
        }
