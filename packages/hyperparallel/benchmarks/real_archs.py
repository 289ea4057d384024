"""Three transformers families on FSDP2, 2 CPU ranks: hyperparallel versus plain FSDP2 recipes.

For a dense model (Qwen3), an MoE (Qwen3-MoE) and an MLA + MoE model (DeepSeek-V3), built from
their transformers classes with small shapes (random weights, same seed), each rank builds the
same model three times and trains the three copies on the same batches, steps interleaved
(A B C, then B C A, ...) so that load from other jobs hits all alike:

(a) hyperparallel: FSDP2 per decoder block, ``get_hyper_optimizer`` (its Muon on the family
    plan's hidden matrices and experts, distributed Newton-Schulz; AdamW on the rest) and
    ``CausalLM``'s chunked head loss (no ``[tokens, vocab]`` logits kept);
(b) plain FSDP2 + ``torch.optim.AdamW`` on every parameter + the model's own transformers loss
    (full fp32 logits, ``shift_labels`` set to the next-token targets);
(c) plain FSDP2 + ``torch.optim.Muon`` + ``torch.optim.AdamW`` (same split as (a)) + the
    transformers loss. torch's Muon takes whole 2-D matrices only, so, as a plain user would,
    each rank keeps a full replicated copy of every Muon matrix (experts split into one 2-D
    matrix each), gathers the gradients with ``full_tensor()`` every step, lets torch's Muon
    orthogonalise every matrix (each rank all of them), and copies its own rows back into the
    FSDP shard.

Balance loss: the family's, weighted by ``router_aux_loss_coef`` in every variant (transformers
adds it to its loss for Qwen3-MoE; DeepSeek-V3 balances by bias, no loss).

Reported per variant: tokens/s over both ranks (slowest rank's step: forward, backward,
optimizer step), the first-step loss (same model and batch: (a) and (b) agree to fp32 rounding),
and memory per rank (maximum over ranks):

- ``state MiB``: exact bytes of what lives across steps on a rank: its parameter shards, the
  optimizer state, and (c)'s replicated full copies.
- ``step peak MiB``: the rise of the process's peak resident set size during one step above the
  resident size before it (Linux ``VmHWM``, reset before each step; median over steps). glibc
  serves every allocation of 256 KiB or more with its own mapping (``mallopt``), so freed
  tensors leave the resident set at once; smaller ones may be reused without showing, so this
  is a lower bound of the transient memory (activations, gradients, logits, gathered matrices).
- ``saved MiB``: exact bytes autograd saved for backward in the step (storages counted once,
  weights excluded: ``hyperparallel.activation.track_saved_activations``).

    uv run python packages/hyperparallel/benchmarks/real_archs.py --out DIR
        [--steps 4] [--seq 128] [--batch 2] [--vocab 32768] [--families dense moe mla-moe]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from hyperparallel.activation import track_saved_activations
from hyperparallel.models.hf import CausalLM
from hyperparallel.optim.hybrid import get_hyper_optimizer
from hyperparallel.parallel.mesh import ParallelDims
from npu_core.bench import BenchTable
from npu_core.dist import launch
from npu_core.memory import memory_stats, reset_peak_memory_stats

WORLD = 2
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "dense": ("Qwen3Config", {}),
    "moe": (
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256},
    ),
    "mla-moe": (
        "DeepseekV3Config",
        {
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "moe_intermediate_size": 256, "first_k_dense_replace": 1, "n_shared_experts": 1,
            "q_lora_rank": 128, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32, "v_head_dim": 64, "head_dim": 32,
        },
    ),
}  # fmt: skip
VARIANTS = (
    "hyperparallel (Muon + chunked head)",
    "FSDP2 + torch AdamW + HF loss",
    "FSDP2 + torch Muon (full_tensor) + HF loss",
)
MUON: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1}
ADAMW: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _map_large_allocations(threshold: int = 256 * 1024) -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def _config(family: str, vocab: int) -> Any:
    config_cls, extra = FAMILIES[family]
    return getattr(transformers, config_cls)(**{**SHAPE, "vocab_size": vocab, **extra})


def _tensor_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    return sum(
        _tensor_bytes(v)
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def _as_dtensor(t: torch.Tensor | None) -> DTensor:
    if not isinstance(t, DTensor):
        raise TypeError(f"expected an FSDP2 (DTensor) parameter or gradient, got {type(t)}")
    return t


class _TorchMuonOnShards:
    """torch.optim.Muon on FSDP2 parameters the plain way: replicated full copies, gradients
    gathered with ``full_tensor()`` each step, own rows copied back into the shard."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params: list[DTensor] = [_as_dtensor(p) for p in params]
        self.leaves: list[list[nn.Parameter]] = []
        for p in self.params:
            full = p.full_tensor().detach()
            mats = full.unbind(0) if full.ndim == 3 else [full]
            self.leaves.append([nn.Parameter(m.clone()) for m in mats])
        flat = [leaf for group in self.leaves for leaf in group]
        self.opt = torch.optim.Muon(flat, adjust_lr_fn="original", **MUON)

    def step(self) -> None:
        for p, leaves in zip(self.params, self.leaves, strict=True):
            grad = _as_dtensor(p.grad).full_tensor()
            grads = grad.unbind(0) if grad.ndim == 3 else [grad]
            for leaf, g in zip(leaves, grads, strict=True):
                leaf.grad = g
        self.opt.step()
        for p, leaves in zip(self.params, self.leaves, strict=True):
            full = torch.stack([leaf.detach() for leaf in leaves]) if p.ndim == 3 else leaves[0]
            local = p.to_local()
            rank = p.device_mesh.get_local_rank()
            rows = p.shape[0] // WORLD + (1 if p.shape[0] % WORLD else 0)  # FSDP2's chunk rows
            local.detach().copy_(full[rank * rows : rank * rows + local.shape[0]])

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def replica_bytes(self) -> int:
        return sum(_tensor_bytes(leaf) for group in self.leaves for leaf in group)


class _Variant:
    """One model copy with its optimizer(s) and its step function."""

    def __init__(self, name: str, family: str, vocab: int, mesh: Any) -> None:
        self.name = name
        torch.manual_seed(0)  # the same initial weights in every variant and on every rank
        hf = transformers.AutoModelForCausalLM.from_config(_config(family, vocab))
        self.wrapper = CausalLM(hf)
        self.aux_coef = float(getattr(hf.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.moe = self.wrapper._balance is not None
        self.hyper = name.startswith("hyperparallel")
        # The plain variants call the transformers model itself, so it is their FSDP2 root.
        root: nn.Module = self.wrapper if self.hyper else hf
        prefix = "" if self.hyper else "model."
        routing = self.wrapper.routing()  # the family plan's split, named as the wrapper names
        muon_names = [n.removeprefix(prefix) for n in routing.muon]
        adamw_names = [n.removeprefix(prefix) for n in routing.adamw]
        for block in self.wrapper.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(root, mesh=mesh)
        self.root = root
        named = dict(root.named_parameters())
        self.replicas: _TorchMuonOnShards | None = None
        self.optimizers: list[Any]
        if self.hyper:
            hyper = get_hyper_optimizer(
                self.wrapper, muon=MUON, adamw=ADAMW, classify=self.wrapper.classify
            )
            self.optimizers = [hyper]
            self.inner = [opt for opt in (hyper.muon, hyper.adamw) if opt is not None]
        elif "AdamW" in name:
            adamw = torch.optim.AdamW(list(named.values()), **ADAMW)
            self.optimizers = self.inner = [adamw]
        else:
            self.replicas = _TorchMuonOnShards([named[n] for n in muon_names])
            adamw = torch.optim.AdamW([named[n] for n in adamw_names], **ADAMW)
            self.optimizers = [self.replicas, adamw]
            self.inner = [self.replicas.opt, adamw]

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.hyper:
            ce, aux = self.wrapper(tokens, targets)
            return ce + self.aux_coef * aux
        extra = {"output_router_logits": True} if self.moe else {}
        out = self.root(
            input_ids=tokens, labels=targets, shift_labels=targets, use_cache=False, **extra
        )
        return out.loss  # transformers adds router_aux_loss_coef x its balance loss itself

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """One training step: (this rank's loss, saved-activation bytes)."""
        with track_saved_activations() as tracker:
            loss = self.loss(tokens, targets)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        for opt in self.optimizers:
            opt.zero_grad()
        return loss.item(), tracker.report().total_bytes

    def state_bytes(self) -> int:
        params = sum(_tensor_bytes(p) for p in self.root.parameters())
        replicas = self.replicas.replica_bytes() if self.replicas is not None else 0
        return params + _state_bytes(self.inner) + replicas


def _batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch (the same for every variant)."""
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    seqs = torch.randint(vocab, (batch, seq + 1), generator=gen)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def _rank(family: str, args: dict[str, int]) -> dict[str, Any]:
    torch.set_num_threads(1)  # 2 ranks share the 2 cores
    mapped = _map_large_allocations()
    mesh = ParallelDims(dp_shard=WORLD).build("cpu").dense
    variants = [_Variant(name, family, args["vocab"], mesh) for name in VARIANTS]
    results: dict[str, dict[str, list[float]]] = {
        v.name: {"time": [], "loss": [], "peak": [], "saved": []} for v in variants
    }
    for step in range(args["warmup"] + args["steps"]):
        tokens, targets = _batch(step, args["batch"], args["seq"], args["vocab"])
        shift = step % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            dist.barrier()
            before = memory_stats("cpu").host_rss_bytes
            reset_peak_memory_stats("cpu")
            began = time.perf_counter()
            loss, saved = variant.step(tokens, targets)
            elapsed = time.perf_counter() - began
            peak = memory_stats("cpu").peak_allocated_bytes - before
            slowest = torch.tensor([elapsed])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            mean_loss = torch.tensor([loss])
            dist.all_reduce(mean_loss)
            record = results[variant.name]
            record["loss"].append(mean_loss.item() / WORLD)
            if step >= args["warmup"]:
                record["time"].append(slowest.item())
                record["peak"].append(float(peak))
                record["saved"].append(float(saved))
    return {
        "results": results,
        "state": {v.name: v.state_bytes() for v in variants},
        "mmap_threshold_set": mapped,
        "rank": int(os.environ.get("RANK", "0")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args()
    settings = {k: getattr(args, k) for k in ("steps", "warmup", "seq", "batch", "vocab")}
    tokens_per_step = WORLD * args.batch * args.seq
    table = BenchTable(
        f"Transformers families on FSDP2, {WORLD} CPU ranks, {tokens_per_step} tokens per step, "
        f"vocab {args.vocab} (median of {args.steps} interleaved steps)",
        [
            "family",
            "variant",
            "tokens/s",
            "vs hyperparallel",
            "first loss",
            "state MiB",
            "step peak MiB",
            "saved MiB",
        ],
        metadata=settings,
    )
    for family in args.families:
        ranks = launch(_rank, WORLD, family, settings, timeout=3600)
        base = ranks[0]["results"][VARIANTS[0]]["time"]
        for name in VARIANTS:
            times = ranks[0]["results"][name]["time"]
            table.add(
                family=f"{family} ({FAMILIES[family][0].removesuffix('Config')})",
                variant=name,
                **{
                    "tokens/s": tokens_per_step / statistics.median(times),
                    "vs hyperparallel": statistics.median(
                        b / t for b, t in zip(base, times, strict=True)
                    ),
                    "first loss": ranks[0]["results"][name]["loss"][0],
                    "state MiB": max(r["state"][name] for r in ranks) / 2**20,
                    "step peak MiB": max(
                        statistics.median(r["results"][name]["peak"]) for r in ranks
                    )
                    / 2**20,
                    "saved MiB": max(max(r["results"][name]["saved"]) for r in ranks) / 2**20,
                },
            )
        print(table.to_markdown(), flush=True)
    _, md_path = table.write(args.out, "real_archs")
    print(md_path.read_text())


if __name__ == "__main__":
    main()
