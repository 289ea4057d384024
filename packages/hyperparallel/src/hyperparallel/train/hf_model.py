"""The train job with a `transformers` causal LM: ``hyperparallel train --model PATH``.

``PATH`` is a local model folder (``config.json``, optionally weights and tokenizer files) or a
``config.json`` file. :class:`TransformersSpec` is its model spec: making one reads and checks it
(:func:`resolve`: the architecture must have a parallelize plan in
:mod:`hyperparallel.models.families`, ``data.seq_len`` must fit ``max_position_embeddings``, the
attention heads must divide by the key/value heads),
once before any rank starts and once in every rank; it then checks layouts, tokenizes the data
and builds the model into the same
:class:`~hyperparallel.train.parallel_model.ParallelModel` the built-in MoE gets, so the loop,
metrics, plot and DCP checkpoints are shared.

Layouts: ``dp_replicate x dp_shard`` (FSDP2 / HSDP, one unit per decoder block), and for MoE
families ``ep`` as well: the routed experts are placed on the expert mesh and their tokens moved
by all-to-all (:mod:`hyperparallel.parallel.hf_expert`, generic over the families' shared experts
contract), the rest sharded by FSDP2 over ``ep x dp_shard``. Under ``pp`` the architectures a
family lists as ``pipelined`` are cut into pipeline stages (embeddings | blocks | final norm and
head, :mod:`hyperparallel.parallel.hf_pipeline`) under every schedule the built-in MoE has, each
stage sharded as the whole model is (experts placed, then FSDP2 per block); other architectures
are refused under ``pp`` naming the ones that are supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.data.tokens import encode, load_text
from hyperparallel.models.families import FamilyPlan, UnknownArchitectureError, plan_for
from hyperparallel.models.hf import CausalLM, build_causal_lm
from hyperparallel.models.hf_weights import check_weights
from hyperparallel.optim.hybrid import Classifier
from hyperparallel.parallel.expert import check_divisible
from hyperparallel.parallel.hf_expert import apply_hf_expert_parallel, expert_modules
from hyperparallel.parallel.hf_pipeline import build_decoder_pipeline, pipeline_refusal
from hyperparallel.parallel.mesh import MeshSet, ParallelDims
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.model_spec import Losses, ModelSpec
from hyperparallel.train.parallel_model import ParallelModel

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
"""Files whose presence makes ``hf.load_weights`` default to True."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Files whose presence makes the model folder the default tokenizer."""


@dataclass(frozen=True)
class HFModel:
    """A checked ``--model``: what to build and how to tokenize.

    Attributes:
        folder: the model folder (the parent of a ``config.json`` path).
        config: the transformers config with ``hf.overrides`` applied.
        architecture: the ``*ForCausalLM`` class name that will be built.
        plan: its family's parallelize plan.
        load_weights: whether the folder's weights are loaded (else random from ``seed``).
        tokenizer: tokenizer folder, or None for bytes mapped into the vocabulary.
    """

    folder: Path
    config: Any
    architecture: str
    plan: FamilyPlan
    load_weights: bool
    tokenizer: Path | None

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_seq_len(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)


def resolve(cfg: TrainConfig) -> HFModel:
    """Read and check ``cfg.hf`` (nothing is downloaded, no weights are read).

    Raises:
        FileNotFoundError: the path, its ``config.json``, asked-for weights or the tokenizer
            folder are missing.
        ValueError: an unreadable config, an architecture without a plan, unknown override
            keys, overrides with loaded weights, or ``data.seq_len`` / ``activation.per_block``
            that do not fit the model; each message is one line naming the setting.
    """
    import transformers

    hf = cfg.hf
    if hf.source is None:
        raise ValueError("hf.source is not set: this job needs --model PATH")
    source = Path(hf.source)
    if not source.exists():
        raise FileNotFoundError(f"--model {source}: no such file or folder")
    if source.is_file() and source.name != "config.json":
        raise ValueError(
            f"--model {source}: a file other than config.json; give a model folder or its "
            "config.json"
        )
    folder = source.parent if source.is_file() else source
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {source}: no config.json in this folder (a transformers model folder "
            "is expected)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # the config classes validate with huggingface_hub's own errors
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(
            f"--model {source}: config.json is not a transformers config ({reason})"
        ) from None
    architecture = _causal_lm_class(config, source)
    try:
        plan = plan_for(getattr(transformers, architecture))
    except UnknownArchitectureError as exc:
        raise ValueError(f"--model {source}: {exc}") from None
    unknown = sorted(set(hf.overrides) - set(config.to_dict()))
    if unknown:
        raise ValueError(
            f"hf.overrides: {', '.join(unknown)} not a field of {type(config).__name__}"
        )
    has_weights = any(any(folder.glob(p)) for p in WEIGHT_PATTERNS)
    load = hf.load_weights if hf.load_weights is not None else has_weights and not hf.overrides
    if load and not has_weights:
        raise FileNotFoundError(
            f"--load-weights: {folder} holds no {' or '.join(WEIGHT_PATTERNS)} files"
        )
    if load and hf.overrides:
        raise ValueError(
            "hf.overrides change the model's shape and cannot apply to loaded weights; drop "
            "them or pass --no-load-weights (random weights)"
        )
    for key, value in hf.overrides.items():
        setattr(config, key, value)
    _check_attention_heads(config, source)
    model = HFModel(folder, config, architecture, plan, load, _tokenizer(cfg, folder))
    if cfg.data.seq_len > model.max_seq_len:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} exceeds max_position_embeddings="
            f"{model.max_seq_len} of --model {source}; lower data.seq_len"
        )
    if len(cfg.activation.per_block) > model.n_layers:
        raise ValueError(
            f"activation.per_block lists {len(cfg.activation.per_block)} policies but --model "
            f"{source} has num_hidden_layers={model.n_layers}; give at most one per block"
        )
    return model


def _check_attention_heads(config: Any, source: Path) -> None:
    """Grouped-query attention shares each key/value head among a whole group of query heads:
    heads that do not divide by the KV heads fail in every rank's first forward otherwise."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not (isinstance(heads, int) and isinstance(kv_heads, int)) or kv_heads <= 0:
        return
    if heads % kv_heads:
        raise ValueError(
            f"--model {source}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads} (each key/value head serves a whole group of query "
            "heads); fix config.json or hf.overrides"
        )


def _causal_lm_class(config: Any, source: Path) -> str:
    """The class ``AutoModelForCausalLM`` builds for ``config`` (its name)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ValueError(
            f"--model {source}: model_type {config.model_type!r} has no causal-LM class in "
            "transformers (only *ForCausalLM architectures train here)"
        )
    return str(name)


def _tokenizer(cfg: TrainConfig, folder: Path) -> Path | None:
    """``hf.tokenizer``: 'bytes', a folder, or (unset) the model folder if it has tokenizer
    files; None means bytes."""
    given = cfg.hf.tokenizer
    if given == "bytes":
        return None
    if given is not None:
        path = Path(given)
        if not path.is_dir():
            raise FileNotFoundError(
                f"--tokenizer {path}: not a folder with tokenizer files (or 'bytes')"
            )
        return path
    return folder if any((folder / name).is_file() for name in TOKENIZER_FILES) else None


EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Config fields that hold the number of routed experts, as the MoE families name it."""


def expert_count(config: Any) -> tuple[str, int] | None:
    """``(field, E)``: the routed-expert count of a transformers config, named as the config
    stores it (through its ``attribute_map``), or None when it has none."""
    aliases = getattr(config, "attribute_map", {}) or {}
    for field in EXPERT_COUNT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return aliases.get(field, field), value
    return None


class TransformersSpec(ModelSpec):
    """The transformers causal LM that ``cfg.hf`` names, read and checked when the spec is made.

    Attributes:
        model: the checked ``--model`` (:func:`resolve`).

    Raises:
        FileNotFoundError, ValueError: as :func:`resolve`.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.model = resolve(cfg)

    @property
    def n_layers(self) -> int:
        return self.model.n_layers

    def check_weights(self) -> None:
        """With ``hf.load_weights``, the folder's weight files must fit its config: names and
        shapes from their headers against the model built on the meta device
        (:func:`hyperparallel.models.hf_weights.check_weights`)."""
        if self.model.load_weights:
            check_weights(self.model.folder, self.model.config)

    def check_model_layout(self, dims: ParallelDims) -> None:
        """pp needs an architecture its family cuts into stages; ep needs a MoE family whose
        expert count divides by ``ep x dp_shard`` (see the module docstring)."""
        model = self.model
        if dims.pp > 1:
            refusal = pipeline_refusal(model.architecture, model.config, model.plan.pipelined)
            if refusal is not None:
                raise ValueError(f"--mesh {dims.spec()}: pp={dims.pp} with --model: {refusal}")
        if dims.ep > 1:
            if model.plan.experts is None:
                raise ValueError(
                    f"--mesh {dims.spec()}: ep={dims.ep} needs a MoE model, and "
                    f"{model.architecture} (family {model.plan.name!r}) has no routed experts; "
                    "use dp_replicate x dp_shard"
                )
            count = expert_count(model.config)
            if count is not None:
                field, n_experts = count
                check_divisible(n_experts, dims.ep, dims.dp_shard, f"--model {field}")

    def batches(self) -> ByteBatches:
        """Windows of the tokenized ``data.path`` (text, JSONL or folder; default the Python
        stdlib), drawn per (seed, sample, step) like the built-in job's."""
        data = self.cfg.data
        text = load_text(data.path, data.max_bytes)
        ids = encode(text, self.model.vocab_size, self.model.tokenizer)
        return ByteBatches(ids, data.seq_len, data.val_fraction, self.cfg.seed)

    def build_module(self, device: torch.device) -> nn.Module:
        """The CausalLM in ``dtype``, as transformers builds it in that dtype: the folder's
        weights, or random weights from ``cfg.seed`` (identical on every rank)."""
        if self.model.load_weights:
            net = build_causal_lm(self.model.folder, load_weights=True, dtype=self.dtype)
        else:
            net = build_causal_lm(self.model.config, seed=self.cfg.seed, dtype=self.dtype)
        return net.to(device).train()

    def place_experts(self, module: nn.Module, meshes: MeshSet) -> list[nn.Parameter]:
        """The experts of the whole CausalLM, or of one pipeline stage's blocks (none on a stage
        of dense blocks only, e.g. DeepSeek-V3's first ``first_k_dense_replace`` blocks)."""
        if not isinstance(module, CausalLM):
            if not expert_modules(module, self.model.plan):
                return []
            return apply_hf_expert_parallel(module, self.model.plan, meshes, self.expert_dispatch())
        return apply_hf_expert_parallel(
            module.model, self.model.plan, meshes, self.expert_dispatch()
        )

    def parallelize(
        self, module: nn.Module, meshes: MeshSet, device: torch.device
    ) -> ParallelModel:
        """Without pp, shard the whole model; with pp, keep this rank's decoder stages and shard
        each (experts placed, FSDP2 per block), under the configured schedule."""
        if meshes.pp is None:
            return super().parallelize(module, meshes, device)
        lm = _causal_lm(module)
        return self.pipelined(build_decoder_pipeline, lm, meshes, device, classify=lm.classify)

    def losses(self, module: nn.Module) -> Losses:
        """The CausalLM itself: ``(tokens, targets) -> (loss, the family's balance loss)``."""
        return _causal_lm(module)

    def classify(self, module: nn.Module) -> Classifier:
        """The family's routing: expert stacks are Muon's, sharded or not."""
        return _causal_lm(module).classify


def _causal_lm(module: nn.Module) -> CausalLM:
    assert isinstance(module, CausalLM), type(module)
    return module
