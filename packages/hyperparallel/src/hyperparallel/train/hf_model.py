"""The train job with a `transformers` causal LM: ``hyperparallel train --model PATH``.

``PATH`` is a local model folder (``config.json``, optionally weights and tokenizer files) or a
``config.json`` file. :func:`resolve` reads and checks it once, before any rank starts (and
again, cheaply, in every rank): the architecture must have a parallelize plan
(:mod:`hyperparallel.models.families`), ``data.seq_len`` must fit ``max_position_embeddings``,
the mesh must be one this job supports. :func:`build` then makes the same
:class:`~hyperparallel.train.model.ParallelModel` the built-in MoE gets, so the loop, metrics,
plot and DCP checkpoints are shared.

Layouts: ``dp_replicate x dp_shard`` (FSDP2 / HSDP, one unit per decoder block). ``pp`` and
``ep`` are refused: pipeline stages and expert placement exist only for the built-in MoE's
module structure, and each transformers family stores its experts differently (fused
``gate_up_proj`` stacks, per-expert modules), so they would need per-family work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.data.tokens import encode, load_text
from hyperparallel.models.families import FamilyPlan, UnknownArchitectureError, plan_for
from hyperparallel.models.hf import build_causal_lm
from hyperparallel.models.parallelize import apply_activation_memory, apply_fsdp
from hyperparallel.parallel.dims import ParallelDims
from hyperparallel.parallel.layout import check_layout
from hyperparallel.parallel.mesh import MeshSet
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.model import ParallelModel

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
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"--model {source}: config.json is not a transformers config ({first})"
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


def check_layout_hf(cfg: TrainConfig, dims: ParallelDims) -> int:
    """:func:`~hyperparallel.parallel.layout.check_layout` for a transformers model: pipeline
    and expert parallelism are refused first (see the module docstring); returns the local
    batch size."""
    for name, size in (("pp", dims.pp), ("ep", dims.ep)):
        if size > 1:
            raise ValueError(
                f"--mesh {dims.spec()}: {name}={size} is not supported with --model (a "
                "transformers model trains on dp_replicate x dp_shard: FSDP2 or HSDP, e.g. "
                "--mesh fsdp or --mesh 2x2)"
            )
    return check_layout(cfg, dims)


def batches(cfg: TrainConfig, model: HFModel) -> ByteBatches:
    """Windows of the tokenized ``data.path`` (text, JSONL or folder; default the Python
    stdlib), drawn per (seed, sample, step) like the built-in job's, so ``--resume`` is exact."""
    text = load_text(cfg.data.path, cfg.data.max_bytes)
    ids = encode(text, model.vocab_size, model.tokenizer)
    return ByteBatches(ids, cfg.data.seq_len, cfg.data.val_fraction, cfg.seed)


def build(cfg: TrainConfig, model: HFModel, meshes: MeshSet, device: torch.device) -> ParallelModel:
    """The CausalLM (random weights from ``cfg.seed``, identical on every rank, or the folder's
    weights), each decoder block an activation region with its policy, then FSDP2 / HSDP per
    block and at the root over ``meshes.dense``. The optimizer routes with ``net.classify``."""
    if model.load_weights:
        net = build_causal_lm(model.folder, load_weights=True)
    else:
        net = build_causal_lm(model.config, seed=cfg.seed)
    net = net.to(device).train()
    act = cfg.activation
    policies = [*act.per_block, *[act.policy] * model.n_layers][: model.n_layers]
    apply_activation_memory(
        net, policies, swap_inputs=act.swap_inputs, swap_threshold_bytes=act.swap_threshold_bytes
    )
    apply_fsdp(net, meshes.dense)
    return ParallelModel(
        net, meshes, net, None, cfg.optim.balance_weight, losses=net, classify=net.classify
    )
