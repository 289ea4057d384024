"""Parallelize plans for `transformers` causal LMs, found by class (a registry, not an if-chain).

Training an architecture with hyperparallel needs three facts about it, and they differ between
families only in names:

* which modules are the decoder blocks: each becomes one FSDP2 unit and one activation region;
* which parameters Muon orthogonalises: the hidden 2-D matrices inside the blocks and the stacked
  expert weights ``[E, ...]`` (one matrix per expert); everything else goes to AdamW
  (embeddings, output head, norms, biases, attention sinks, router gates, convolution kernels);
* which parameters are expert stacks, whose dim 0 is the one expert parallelism shards.

A :class:`FamilyPlan` states them as data (attribute path and name patterns), so a new family is a
registration, not a code change. :func:`plan_for` finds the plan by walking the model's class
hierarchy, so subclasses of a registered architecture are covered too. Routing is strict: a
block parameter with more than two dimensions that is not an expert stack is a layout the plan
does not know, and it is refused rather than guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from torch import nn

Kind = Literal["dense", "moe", "mla+moe"]

_ADAMW_IN_BLOCKS = r"(?:bias|_bias|sinks|A_log|dt_bias)$"
"""Block parameters that are never matrices to orthogonalise, whatever their shape."""


class UnknownArchitectureError(LookupError):
    """No plan for a model class; the message lists the families and how to add one."""


@dataclass(frozen=True)
class Routing:
    """Where each trainable parameter goes, by name.

    Attributes:
        muon: hidden matrices and expert stacks, in ``named_parameters`` order.
        adamw: everything else.
        experts: the subset of ``muon`` that are expert stacks ``[E, ...]`` (shardable on dim 0).
    """

    muon: tuple[str, ...]
    adamw: tuple[str, ...]
    experts: tuple[str, ...]


@dataclass(frozen=True)
class FamilyPlan:
    """How one family of architectures is parallelized.

    Attributes:
        name: the family, for messages and ``--help``.
        architectures: ``transformers`` class names it covers (``Qwen3MoeForCausalLM``).
        kind: dense, MoE, or multi-head latent attention + MoE.
        layers: attribute path from the model to the ``nn.ModuleList`` of decoder blocks.
        router: regex (searched in parameter names) of router/gate weights, AdamW even if 2-D.
        experts: regex of stacked expert weights ``[E, ...]``: Muon, one matrix per expert.
        pipelined: the architectures (of ``architectures``) cut into pipeline stages under
            ``pp``: decoders whose forward is the token embedding, blocks that take one rotary
            embedding (or one per layer type, as Gemma 3's) and a full, sliding-window or
            indexed causal mask, then the final norm, with the
            embedding, rotary embedding and norm beside the blocks (``embed_tokens``,
            ``rotary_emb``, ``norm``); see :mod:`hyperparallel.parallel.hf_pipeline`.
    """

    name: str
    architectures: tuple[str, ...]
    kind: Kind
    layers: str = "model.layers"
    router: str | None = None
    experts: str | None = None
    pipelined: tuple[str, ...] = ()

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The decoder blocks, in order."""
        node: object = model
        for attribute in self.layers.split("."):
            if not hasattr(node, attribute):
                raise UnknownArchitectureError(
                    f"{type(model).__name__}: family {self.name!r} expects its blocks at "
                    f"model.{self.layers}, but there is no {attribute!r}"
                )
            node = getattr(node, attribute)
        if not isinstance(node, nn.ModuleList):
            raise UnknownArchitectureError(
                f"{type(model).__name__}.{self.layers} is a {type(node).__name__}, not the "
                "nn.ModuleList of decoder blocks"
            )
        return node

    def route(self, model: nn.Module) -> Routing:
        """Split the trainable parameters between Muon and AdamW (see the module docstring)."""
        prefix = self.layers + "."
        muon: list[str] = []
        adamw: list[str] = []
        experts: list[str] = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            in_block = name.startswith(prefix)
            if self.experts is not None and in_block and re.search(self.experts, name):
                if param.ndim != 3:
                    raise ValueError(
                        f"{name}: family {self.name!r} takes it for an expert stack [E, M, N] "
                        f"but its shape is {tuple(param.shape)}"
                    )
                muon.append(name)
                experts.append(name)
            elif (
                not in_block
                or param.ndim < 2
                or re.search(_ADAMW_IN_BLOCKS, name)
                or (self.router is not None and re.search(self.router, name))
            ):
                adamw.append(name)
            elif param.ndim == 2:
                muon.append(name)
            elif _is_convolution_kernel(model, name):
                adamw.append(name)
            else:
                raise ValueError(
                    f"{name}: a {param.ndim}-D parameter {tuple(param.shape)} that family "
                    f"{self.name!r} does not place (not an expert stack, not a matrix); "
                    "register a plan whose `experts` pattern covers it"
                )
        return Routing(tuple(muon), tuple(adamw), tuple(experts))


def _is_convolution_kernel(model: nn.Module, name: str) -> bool:
    owner = model.get_submodule(name.rpartition(".")[0])
    return isinstance(owner, nn.modules.conv._ConvNd)


_FAMILIES: dict[str, FamilyPlan] = {}
_BY_ARCHITECTURE: dict[str, FamilyPlan] = {}


def register(plan: FamilyPlan, *, replace: bool = False) -> FamilyPlan:
    """Add a family; an architecture already claimed by another family is refused."""
    for architecture in plan.architectures:
        owner = _BY_ARCHITECTURE.get(architecture)
        if owner is not None and owner.name != plan.name and not replace:
            raise ValueError(f"{architecture} already belongs to family {owner.name!r}")
    if plan.name in _FAMILIES and not replace:
        raise ValueError(f"family {plan.name!r} is already registered")
    old = _FAMILIES.pop(plan.name, None)
    for architecture in old.architectures if old else ():
        _BY_ARCHITECTURE.pop(architecture, None)
    _FAMILIES[plan.name] = plan
    _BY_ARCHITECTURE.update(dict.fromkeys(plan.architectures, plan))
    return plan


def unregister(name: str) -> None:
    plan = _FAMILIES.pop(name, None)
    for architecture in plan.architectures if plan else ():
        _BY_ARCHITECTURE.pop(architecture, None)


def families() -> list[FamilyPlan]:
    """Every registered family, in registration order."""
    return list(_FAMILIES.values())


def plan_for(model: nn.Module | type) -> FamilyPlan:
    """The plan of ``model``'s class or its nearest registered base class.

    Raises:
        UnknownArchitectureError: listing the supported families and how to register one.
    """
    cls = model if isinstance(model, type) else type(model)
    for base in cls.__mro__:
        plan = _BY_ARCHITECTURE.get(base.__name__)
        if plan is not None:
            return plan
    supported = "; ".join(f"{p.name}: {', '.join(p.architectures)}" for p in families())
    raise UnknownArchitectureError(
        f"no parallelize plan for {cls.__name__}. Supported families: {supported}. "
        "Register one with hyperparallel.models.families.register(FamilyPlan(name=..., "
        "architectures=(...), kind=..., layers=..., router=..., experts=...))"
    )


_ROUTER = r"\.mlp\.(?:gate|router|shared_expert_gate)\.weight$"
_EXPERTS = r"\.mlp\.experts\.(?:gate_up_proj|down_proj)$"

register(
    FamilyPlan(
        "dense",
        (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "Phi3ForCausalLM",
            "Gemma3ForCausalLM",
        ),
        "dense",
        pipelined=(
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "Phi3ForCausalLM",
            "Gemma3ForCausalLM",
        ),
    )
)
register(
    FamilyPlan(
        "moe",
        (
            "Qwen3MoeForCausalLM",
            "Qwen3NextForCausalLM",
            "Glm4MoeForCausalLM",
            "MiniMaxM2ForCausalLM",
            "GptOssForCausalLM",
        ),
        "moe",
        router=_ROUTER,
        experts=_EXPERTS,
        pipelined=(
            "Qwen3MoeForCausalLM",
            "Glm4MoeForCausalLM",
            "MiniMaxM2ForCausalLM",
            "GptOssForCausalLM",
        ),
    )
)
register(
    FamilyPlan(
        "mla-moe",
        ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"),
        "mla+moe",
        router=_ROUTER,
        experts=_EXPERTS,
        pipelined=("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"),
    )
)
