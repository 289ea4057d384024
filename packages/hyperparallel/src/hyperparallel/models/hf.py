"""A `transformers` causal LM as hyperparallel's trainer sees a model.

The trainer needs ``model.layers`` (the decoder blocks: FSDP2 units and activation regions) and a
forward that returns ``(loss, aux)``; a transformers ``*ForCausalLM`` has neither in that form.
:class:`CausalLM` wraps one without copying or renaming its parameters (their names stay
``model.model.layers.0...``, prefixed by ``model.``), so checkpoints keep the library's names.

The loss goes through :func:`~hyperparallel.models.lm_loss.chunked_linear_cross_entropy` on the
decoder's final hidden states, so the ``[tokens, vocab]`` logits are never materialised. ``aux``
is the family's own load-balancing loss where the library defines one (Qwen3-MoE, gpt-oss,
MiniMax-M2, Qwen3-Next: ``load_balancing_loss_func`` over the router logits, unweighted as
transformers returns it in ``aux_loss``); families balanced without an auxiliary loss
(DeepSeek-V3's and GLM-4.5's bias correction) and dense models return 0.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hyperparallel.models.families import FamilyPlan, Routing, plan_for
from hyperparallel.models.lm_loss import DEFAULT_CHUNK_ROWS, chunked_linear_cross_entropy

if TYPE_CHECKING:  # the `hf` extra; only annotations need it here
    from transformers import PreTrainedModel


class CausalLM(nn.Module):
    """Wraps a transformers ``*ForCausalLM``: ``.layers`` and ``forward(tokens, targets)``.

    Attributes:
        model: the wrapped transformers model (its parameters, under the prefix ``model.``).
        plan: its family's parallelize plan.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        plan: FamilyPlan | None = None,
        *,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        super().__init__()
        self.model = model
        self.plan = plan or plan_for(model)
        self.chunk_rows = chunk_rows
        self._balance = _balance_loss(model)
        self._muon_names: frozenset[str] | None = None

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks (not registered twice: they stay under ``model.``)."""
        return self.plan.blocks(self.model)

    @property
    def decoder(self) -> nn.Module:
        """The decoder stack that holds the blocks (embeddings, rotary embedding, final norm)."""
        return self.model.get_submodule(self.plan.layers.rpartition(".")[0])

    @property
    def balance(self) -> Callable[[tuple[Tensor, ...]], Tensor] | None:
        """The family's load-balancing loss over a tuple of router logits, or None."""
        return self._balance

    def routing(self) -> Routing:
        """The family's Muon / AdamW / expert routing, named as this wrapper names them."""
        inner = self.plan.route(self.model)
        return Routing(
            *(tuple(f"model.{name}" for name in names) for names in dataclasses.astuple(inner))
        )

    def classify(self, name: str, param: Tensor) -> str:
        """``get_hyper_optimizer(..., classify=wrapper.classify)``: the family's routing."""
        if self._muon_names is None:  # routed once, when the optimizer is built
            self._muon_names = frozenset(self.routing().muon)
        return "muon" if name in self._muon_names else "adamw"

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the configuration admits (its ``max_position_embeddings``)."""
        return int(self.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def forward(self, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """``tokens, targets: [B, S]`` -> (mean cross-entropy, auxiliary balance loss)."""
        seq = tokens.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_position_embeddings={self.max_seq_len}"
            )
        extra = {"output_router_logits": True} if self._balance is not None else {}
        decoder = self.model.model  # the decoder stack under the LM head
        if not isinstance(decoder, nn.Module):
            raise TypeError(f"{type(self.model).__name__}.model is not the decoder module")
        out = decoder(input_ids=tokens, use_cache=False, **extra)
        head = self.model.get_output_embeddings()
        loss = chunked_linear_cross_entropy(
            out.last_hidden_state,
            head.weight,
            targets,
            head.bias,
            chunk_rows=self.chunk_rows,
            softcap=getattr(self.model.config, "final_logit_softcapping", None),
        )
        if self._balance is None:
            return loss, loss.new_zeros(())
        return loss, self._balance(out.router_logits)


def _balance_loss(model: nn.Module) -> Any:
    """The family's ``load_balancing_loss_func`` bound to the model's expert counts, or None."""
    module = sys.modules[type(model).__module__]
    func = getattr(module, "load_balancing_loss_func", None)
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if func is None or not experts or not top_k:
        return None

    def balance(router_logits: tuple[Tensor, ...]) -> Tensor:
        loss: Tensor = func(router_logits, experts, top_k, None)
        return loss

    return balance


def build_causal_lm(
    source: str | Path | Any,
    *,
    overrides: dict[str, Any] | None = None,
    load_weights: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """A :class:`CausalLM` from a local model folder, a ``config.json``, or a config object.

    Args:
        source: a folder with ``config.json`` (and weights, for ``load_weights``), a path to a
            ``config.json``, or a ``transformers.PretrainedConfig``. Nothing is downloaded.
        overrides: config fields replaced before building (a card's tiny shape).
        load_weights: load the folder's weights; otherwise random weights from ``seed``, the
            same on every rank.
        seed: seed of the random weights.
        dtype: parameter dtype.

    Raises:
        FileNotFoundError: the folder or file does not exist, or weights were asked for from a
            bare ``config.json``.
    """
    import transformers

    if isinstance(source, str | Path):
        path = Path(source)
        folder = path.parent if path.name == "config.json" else path
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json there (expected a model folder)")
        if load_weights and overrides:
            raise ValueError("overrides change the shape; they cannot apply to loaded weights")
        if load_weights:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, local_files_only=True
            )
            return CausalLM(model)
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    else:
        if load_weights:
            raise FileNotFoundError("load_weights needs a model folder, not a config object")
        config = source
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return CausalLM(model)
