"""Pipeline stages cut from a `transformers` decoder, for ``--model`` with ``--mesh pp=...``.

A transformers decoder's forward embeds the tokens, computes the rotary ``position_embeddings``
and the attention masks once, passes them to every block, then applies the final norm; the
causal-LM head follows. A pipeline stage holds only some of the blocks, so
:class:`DecoderStage` redoes that per stage: the embedding on the first stage, its blocks with
rotary embeddings from the decoder's own ``rotary_emb`` and masks from transformers'
``create_causal_mask`` / ``create_sliding_window_causal_mask`` (the same calls, for each block's
``layer_types`` entry, that the decoder makes with no padding mask and no cache, as the
unpipelined training path runs it), and the final norm and head on the last stage. Only the
architectures a family lists in ``FamilyPlan.pipelined`` are cut: their decoders have exactly
that forward (one rotary embedding for every block, or one per layer type as Gemma 3's; full,
sliding-window or DeepSeek-V3.2's indexed attention masks); each is checked against the
library's own forward in the tests.

The stages keep the wrapper's parameter names (``model.model.layers.3...``,
``model.lm_head.weight``) through :class:`DecoderStagesView`, so DCP checkpoints reshard between
pipeline and other layouts. A family's load-balancing loss (Qwen3-MoE's
``load_balancing_loss_func``) is computed per stage over its own blocks' router logits, weighted
by the stage's share of the blocks, and attached to the hidden state's gradient
(:class:`~hyperparallel.parallel.pipeline.AttachAux`): the library's loss is one term over all
blocks' routers together, which no stage sees, so under pp it is this per-stage average.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hyperparallel.models.hf import CausalLM
from hyperparallel.parallel.pipeline import AttachAux, Pipeline, build_stages

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_MASKS = {
    "full_attention": ("create_causal_mask", True),
    "sliding_attention": ("create_sliding_window_causal_mask", True),
    "indexed_attention": ("create_causal_mask", False),
}
"""``config.layer_types`` entry -> (transformers mask function, whether the kernel may skip an
all-causal mask). DeepSeek-V3.2's indexed attention needs the explicit mask (its indexer reads
it), so its decoder passes ``allow_is_causal_skip=False``, as the stage does."""

MASKED_LAYER_TYPES = tuple(_MASKS)
"""``config.layer_types`` entries a stage builds masks for (others, e.g. linear attention, are
refused)."""


def pipeline_refusal(lm_architecture: str, config: Any, pipelined: tuple[str, ...]) -> str | None:
    """Why a causal LM of ``lm_architecture`` cannot be cut into stages, or None if it can.

    ``pipelined`` is its family's ``FamilyPlan.pipelined``.
    """
    supported = ", ".join(pipelined) or "none in its family"
    if lm_architecture not in pipelined:
        return (
            f"{lm_architecture} is not cut into pipeline stages (its family's pipelined "
            f"architectures: {supported})"
        )
    if getattr(config, "tie_word_embeddings", False):
        return (
            f"{lm_architecture} ties its embedding to the output head "
            "(tie_word_embeddings=True), and they sit on different pipeline stages"
        )
    types = set(getattr(config, "layer_types", None) or ())
    if types - set(MASKED_LAYER_TYPES):
        return (
            f"{lm_architecture} has layer types {sorted(types - set(MASKED_LAYER_TYPES))}; "
            f"pipeline stages build masks for {', '.join(MASKED_LAYER_TYPES)} only"
        )
    return None


class DecoderStage(nn.Module):
    """Blocks ``layers`` of a transformers decoder (names kept), the token embedding on the first
    stage, the final norm and the LM head on the last.

    ``forward``: tokens ``[B, S]`` int64 (first stage) or hidden ``[B, S, H]`` -> hidden, or
    logits ``[B, S, vocab]`` (fp32-softcapped as the family's ``final_logit_softcapping`` asks)
    on the last stage.
    """

    embed_tokens: nn.Module | None
    norm: nn.Module | None
    lm_head: nn.Module | None
    rotary_emb: nn.Module

    def __init__(
        self, lm: CausalLM, layers: range, first: bool, last: bool, balance_scale: float
    ) -> None:
        super().__init__()
        decoder = lm.decoder
        self.config = decoder.config
        self.embed_tokens = decoder.get_submodule("embed_tokens") if first else None
        self.layers = nn.ModuleDict({str(i): lm.layers[i] for i in layers})
        self.norm = decoder.get_submodule("norm") if last else None
        self.lm_head = lm.model.get_output_embeddings() if last else None
        # the rotary embedding holds buffers only (inv_freq): every stage shares the module
        self.rotary_emb = decoder.get_submodule("rotary_emb")
        self.rotary_per_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        types = getattr(self.config, "layer_types", None)
        self.layer_types = [types[i] if types else _default_layer_type(self.config) for i in layers]
        self.balance = lm.balance if balance_scale else None
        self.balance_scale = balance_scale * len(layers)
        self.router = _router_recorder(lm.model) if self.balance is not None else None

    def forward(self, x: Tensor) -> Tensor:
        """One stage of the decoder forward (see the class docstring)."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        kinds = set(self.layer_types)
        masks = {kind: _mask(kind, self.config, x, positions) for kind in kinds}
        if self.rotary_per_type:  # Gemma 3: local and global rotary bases
            rotary = {kind: self.rotary_emb(x, positions, kind) for kind in kinds}
        else:
            rotary = dict.fromkeys(kinds, self.rotary_emb(x, positions))
        logits: list[Tensor] = []
        with _recording(self, logits):
            for kind, layer in zip(self.layer_types, self.layers.values(), strict=True):
                out = layer(
                    x,
                    attention_mask=masks[kind],
                    position_embeddings=rotary[kind],
                    position_ids=positions,
                    use_cache=False,
                )
                x = out[0] if isinstance(out, tuple) else out
        if self.balance is not None and logits and torch.is_grad_enabled():
            x = AttachAux.apply(x, self.balance(tuple(logits)) * self.balance_scale)
        if self.norm is not None and self.lm_head is not None:  # both on the last stage only
            x = self.lm_head(self.norm(x))
            softcap = getattr(self.config, "final_logit_softcapping", None)
            if softcap:
                x = torch.tanh(x / softcap) * softcap
        return x


def _default_layer_type(config: Any) -> str:
    """A decoder without ``layer_types`` masks every block alike: sliding-window when its
    config sets a ``sliding_window`` (Mistral, Qwen3-MoE), full causal otherwise."""
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _mask(kind: str, config: Any, hidden: Tensor, positions: Tensor) -> Any:
    """The decoder's mask for blocks of ``kind`` (no padding mask, no cache), as its forward
    builds it; None where the attention kernel masks causally by itself."""
    from transformers import masking_utils

    function, may_skip = _MASKS[kind]
    return getattr(masking_utils, function)(
        config=config,
        inputs_embeds=hidden,
        attention_mask=None,
        cache=None,
        position_ids=positions,
        allow_is_causal_skip=may_skip,
    )


def _router_recorder(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """``(router class, index of its logits in the output)``: the family's own record of where
    its router logits come from (``_can_record_outputs['router_logits']``)."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        for sub in model.modules():
            recorder = (getattr(sub, "_can_record_outputs", None) or {}).get("router_logits")
            if recorder is not None:
                break
    if recorder is None:
        return None
    if isinstance(recorder, type):
        return recorder, 0
    return recorder.target_class, int(recorder.index or 0)


@contextmanager
def _recording(stage: DecoderStage, into: list[Tensor]) -> Iterator[None]:
    """Collects the router logits of ``stage``'s blocks into ``into`` while its forward runs."""
    if stage.router is None:
        yield
        return
    cls, index = stage.router

    def hook(_: nn.Module, __: Any, output: Any) -> None:
        into.append(output[index] if isinstance(output, tuple) else output)

    handles = [
        sub.register_forward_hook(hook)
        for layer in stage.layers.values()
        for sub in layer.modules()
        if isinstance(sub, cls)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class DecoderStagesView(nn.Module):
    """This rank's stages under the :class:`CausalLM` wrapper's parameter names, for state dicts
    and the optimizer (``model.model.embed_tokens.weight``, ``model.model.layers.3...``,
    ``model.model.norm.weight``, ``model.lm_head.weight``)."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        causal, decoder = nn.Module(), nn.Module()
        decoder.layers = nn.ModuleDict()
        for stage in stages:
            assert isinstance(stage, DecoderStage)
            for name, layer in stage.layers.items():
                decoder.layers[name] = layer
            for part in ("embed_tokens", "norm"):
                if getattr(stage, part) is not None:
                    setattr(decoder, part, getattr(stage, part))
            if stage.lm_head is not None:
                causal.lm_head = stage.lm_head
        causal.model = decoder
        self.model = causal


def build_decoder_pipeline(
    lm: CausalLM,
    *,
    schedule: str,
    microbatches: int,
    virtual_stages: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    balance_weight: float,
    shard: Callable[[nn.Module], None],
    early_recompute: bool = False,
) -> Pipeline:
    """Cut ``lm`` into this rank's :class:`DecoderStage` s and pipeline them under ``schedule``
    (:func:`~hyperparallel.parallel.pipeline.build_stages`; ``shard`` places experts and
    applies FSDP2 per stage). ``balance_weight`` weighs the family's balance loss."""
    n_layers = len(lm.layers)
    scale = balance_weight / n_layers

    def make_stage(layers: range, first: bool, last: bool) -> nn.Module:
        return DecoderStage(lm, layers, first, last, scale)

    return build_stages(
        make_stage,
        DecoderStagesView,
        n_layers=n_layers,
        hidden_dim=int(lm.model.config.hidden_size),
        dtype=lm.model.dtype,
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        pp_mesh=pp_mesh,
        device=device,
        shard=shard,
        early_recompute=early_recompute,
    )
