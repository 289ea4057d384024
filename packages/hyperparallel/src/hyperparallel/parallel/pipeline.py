"""Pipeline parallelism with ``torch.distributed.pipelining``: the schedules, and the built-in MoE's
stages.

:func:`build_stages` is the model-independent part: which stages a rank holds under each
schedule, sharding each stage, and the schedule over the pp mesh. The built-in MoE's stages
(:class:`StageModule`, :func:`build_pipeline`) are described below; a transformers decoder's are
in :mod:`hyperparallel.parallel.hf_pipeline`.

Every rank builds the whole model from the same seed (so each layout starts from the FSDP run's
weights), then keeps its stages: contiguous runs of blocks, the embedding on the first stage, the
final norm and head on the last. Stage modules keep the model's parameter names
(``layers.3.attn.qkv.weight``), so DCP checkpoints reshard between pipeline and non-pipeline
layouts. The MoE balance loss never leaves its stage: each block attaches its weighted balance
term to the hidden state's gradient (the identity forward of :class:`AttachAux`), as Megatron
does for auxiliary losses.

Schedules (``--pp-schedule``): ``1f1b`` (one stage per rank), ``interleaved_1f1b`` (``v`` stages
per rank, looped), ``dualpipev`` (two stages per rank in a V; it pairs one micro-batch's
backward with another's forward in OVERLAP_F_B actions). torch's ``ScheduleZBVZeroBubble`` is
not offered: with this model on FSDP its second-step loss was 2.8e-3 away from the FSDP run's
(the first equal), so its gradients differ; the V placement code below still covers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyperparallel.models.moe import MoETransformer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "dualpipev")
"""Names accepted by ``--pp-schedule``."""

_SCHEDULE_CLASS = {
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "dualpipev": "ScheduleDualPipeV",
}


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages each rank holds: 1 for 1F1B, 2 for the V schedules, ``virtual_stages`` looped."""
    if schedule == "1f1b":
        return 1
    if schedule == "dualpipev":
        return 2
    return virtual_stages


def stage_ids(schedule: str, pp: int, pp_rank: int, per_rank: int) -> list[int]:
    """Global stage indices held by ``pp_rank`` (looped for interleaved, V-shaped for V)."""
    if schedule == "dualpipev":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous block ranges per stage, earlier stages one block longer when uneven.

    Raises:
        ValueError: fewer blocks than stages (naming both).
    """
    if n_layers < n_stages:
        raise ValueError(
            f"model.n_layers={n_layers} is fewer than the {n_stages} pipeline stages; every "
            "stage needs at least one block (raise model.n_layers or lower pp)"
        )
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


class AttachAux(torch.autograd.Function):
    """Forward returns ``x``; backward also sends gradient 1 into ``aux`` (a scalar loss term),
    so a stage's balance loss is trained without passing it through the pipeline (the built-in
    MoE's stages and the transformers stages of :mod:`hyperparallel.parallel.hf_pipeline`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.clone()  # not a view: FSDP's pre-backward hook must see the stage output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


class StageModule(nn.Module):
    """Blocks ``layers`` of ``model`` (names kept), plus the embedding on the first stage and
    the final norm and head on the last. ``balance_scale`` weights each block's balance loss
    (``balance_weight / n_layers``, the non-pipeline run's mean over blocks)."""

    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(
        self, model: MoETransformer, layers: range, first: bool, last: bool, balance_scale: float
    ) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.balance_scale = balance_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``[B, S]`` int64 (first stage) or hidden ``[B, S, D]`` -> hidden, or logits
        ``[B, S, vocab]`` on the last stage."""
        if self.embed is not None:
            x = self.embed(x)
        seq = x.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers.values():
            x, balance = layer(x, cos, sin)
            if self.balance_scale and torch.is_grad_enabled():
                x = AttachAux.apply(x, balance * self.balance_scale)
        if self.norm is not None and self.lm_head is not None:  # both on the last stage only
            x = self.lm_head(self.norm(x))
        return x


class StagesView(nn.Module):
    """This rank's stage modules under the full model's names, for state dicts and optimizers
    (``embed.weight``, ``layers.3...``, ``norm.weight``, ``lm_head.weight``)."""

    def __init__(self, stages: list[StageModule]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name, layer in stage.layers.items():
                self.layers[name] = layer
            for part in ("embed", "norm", "lm_head"):
                if getattr(stage, part) is not None:
                    setattr(self, part, getattr(stage, part))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [B, S, V]`` against ``targets [B, S]`` (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def stage_holder(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank holding global ``stage`` (inverse of :func:`stage_ids`)."""
    if schedule == "dualpipev":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stage modules, a view with the model's names, the
    schedule, and whether it feeds tokens (first stage) and computes the loss (last stage)."""

    stages: list[nn.Module]
    view: nn.Module
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    has_first: bool
    has_last: bool
    schedule_name: str
    stage_ids: list[int]
    n_stages: int
    group: dist.ProcessGroup
    hidden_dim: int
    dtype: torch.dtype
    device: torch.device

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch over the micro-batches; the mean loss on the rank
        holding the last stage, None elsewhere."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
            return torch.stack([loss.detach() for loss in losses]).mean()
        self.schedule.step(*args, return_outputs=False)
        return None

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward-only loss of one whole batch (validation), on the last stage's rank.

        Runs the stages in order with plain send/recv instead of ``schedule.eval``, which fails
        for the V schedules in torch 2.14 ("can't steal_bwd_input if this stage doesn't have
        backward"); validation is rare, so its pipeline bubble does not matter.
        """
        pp = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        x = inputs
        for index in range(self.n_stages):
            holder = stage_holder(self.schedule_name, pp, index)
            before = stage_holder(self.schedule_name, pp, index - 1) if index else holder
            if holder != me:
                if before == me:
                    dist.send(x.contiguous(), dist.get_global_rank(self.group, holder), self.group)
                continue
            if before != me:
                x = torch.empty(
                    (*inputs.shape, self.hidden_dim), dtype=self.dtype, device=self.device
                )
                dist.recv(x, dist.get_global_rank(self.group, before), self.group)
            x = self.stages[self.stage_ids.index(index)](x)
        return lm_loss(x, targets) if self.has_last else None


def _weights_in_full_backward() -> Callable[[], None]:
    """``dw_builder`` of the V schedules' stages: their ``BACKWARD_INPUT`` action then runs the
    full backward (input and weight gradients, as 1F1B does) and ``BACKWARD_WEIGHT`` nothing.

    Why: torch 2.14's split backward (``stage_backward_input`` then ``stage_backward_weight``,
    which replays the weight half from saved intermediate gradients) gave this model wrong
    weight gradients on the last stage's block under DualPipeV: 0.80-0.95 of the norm and
    cosine 0.94-0.99 against the FSDP run's, while every other parameter matched to 3e-7.
    That was the 4e-4 second-step loss gap (and ZBV's 2.8e-3); torch tracks the same class of
    bug for weights used at several sites (pytorch/pytorch#180952). The schedule keeps its
    order, pairing one micro-batch's backward with another's forward; what is lost is only the
    deferral of the weight half into pipeline bubbles.
    """
    return _no_weight_pass


def _no_weight_pass() -> None:
    """The weight half, already done by the full backward."""


def build_pipeline(
    model: MoETransformer,
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
    """Cut the built-in MoE into this rank's stages (:class:`StageModule`) and pipeline them
    (:func:`build_stages`)."""
    scale = balance_weight / len(model.layers)

    def make_stage(layers: range, first: bool, last: bool) -> nn.Module:
        return StageModule(model, layers, first, last, scale)

    return build_stages(
        make_stage,
        lambda modules: StagesView(cast(list[StageModule], modules)),
        n_layers=len(model.layers),
        hidden_dim=model.embed.weight.shape[-1],
        dtype=model.embed.weight.dtype,
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        pp_mesh=pp_mesh,
        device=device,
        shard=shard,
        early_recompute=early_recompute,
    )


MakeStage = Callable[[range, bool, bool], nn.Module]
"""``(blocks, first, last) -> stage module``: blocks ``[a, b)`` of the model, the embedding when
``first`` and the final norm and head when ``last``; tokens or hidden in, hidden or logits out."""


def build_stages(
    make_stage: MakeStage,
    make_view: Callable[[list[nn.Module]], nn.Module],
    *,
    n_layers: int,
    hidden_dim: int,
    dtype: torch.dtype,
    schedule: str,
    microbatches: int,
    virtual_stages: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    shard: Callable[[nn.Module], None],
    early_recompute: bool = False,
) -> Pipeline:
    """Make this rank's stages (``make_stage`` over :func:`split_layers`), shard each
    (``shard``: FSDP / EP per stage), and build the ``torch.distributed.pipelining`` schedule over
    ``pp_mesh``. ``make_view`` gathers the stages under the full model's parameter names;
    ``hidden_dim`` and ``dtype`` describe what flows between stages. ``early_recompute``
    (1f1b, dualpipev) uses hyperparallel.activation's schedules that replay a micro-batch's
    checkpointed blocks ahead of its backward."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    per_rank = stages_per_rank(schedule, virtual_stages)
    n_stages = pp * per_rank
    ranges = split_layers(n_layers, n_stages)
    held = stage_ids(schedule, pp, pp_rank, per_rank)
    modules, stages = [], []
    for index in held:
        module = make_stage(ranges[index], index == 0, index == n_stages - 1)
        shard(module)
        modules.append(module)
        # V schedules split each backward into input (I) and weight (W) actions; the split
        # path's weight gradients are wrong here, so the I action runs the whole backward.
        v_shape = schedule == "dualpipev"
        stages.append(
            PipelineStage(
                module,
                index,
                n_stages,
                device,
                group=pp_mesh.get_group(),
                dw_builder=_weights_in_full_backward if v_shape else None,
            )
        )
    cls = getattr(pipelining, _SCHEDULE_CLASS[schedule])
    if early_recompute:
        from hyperparallel.activation import EarlyRecompute1F1B, EarlyRecomputeDualPipeV

        cls = {"1f1b": EarlyRecompute1F1B, "dualpipev": EarlyRecomputeDualPipeV}[schedule]
    if schedule == "1f1b":
        runner = cls(stages[0], microbatches, loss_fn=lm_loss)
    else:
        runner = cls(stages, microbatches, loss_fn=lm_loss)
    return Pipeline(
        modules,
        make_view(modules),
        runner,
        has_first=0 in held,
        has_last=n_stages - 1 in held,
        schedule_name=schedule,
        stage_ids=held,
        n_stages=n_stages,
        group=pp_mesh.get_group(),
        hidden_dim=hidden_dim,
        dtype=dtype,
        device=device,
    )
