"""FSDP2 / HSDP and activation regions per block, for any model with ``layers`` of blocks.

The meshes come from :mod:`hyperparallel.parallel.mesh`; which model is built is the train job's
model spec (:mod:`hyperparallel.train.model_spec`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hyperparallel.activation import checkpoint_wrapper, resolve


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model or of a pipeline stage (``layers`` list or dict).

    Raises:
        TypeError: ``model.layers`` is neither a ``ModuleList``/``Sequential`` nor a
            ``ModuleDict``.
    """
    layers = model.layers
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList | nn.Sequential):
        return list(layers)
    raise TypeError(
        f"{type(model).__name__}.layers is a {type(layers).__name__}; expected a ModuleList, "
        "Sequential or ModuleDict of blocks"
    )


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, ignored_params: set[nn.Parameter] | None = None
) -> nn.Module:
    """Shard every block, then the rest (embedding, final norm, head) at the root.

    On a 2-D mesh fully_shard is HSDP: parameters are replicated over the first mesh dimension
    and sharded over the second. ``ignored_params`` (expert-parallel experts, placed by
    :mod:`hyperparallel.parallel.expert`) are left to their owner.
    """
    for layer in blocks(model):
        fully_shard(layer, mesh=mesh, ignored_params=ignored_params)
    fully_shard(model, mesh=mesh, ignored_params=ignored_params)
    return model


def apply_activation_memory(
    model: nn.Module,
    policies: list[str],
    *,
    swap_inputs: bool = False,
    swap_threshold_bytes: int = 1 << 16,
) -> nn.Module:
    """Make each block a checkpointed region with its own policy (``"none"`` leaves it alone).

    ``policies[i]`` applies to block i; the last entry repeats for the remaining blocks. Apply
    before or after :func:`apply_fsdp`; parameter names do not change.
    """
    if not policies:
        return model
    for i, layer in enumerate(blocks(model)):
        name = policies[min(i, len(policies) - 1)]
        if name != "none":
            policy = resolve(name, swap_threshold_bytes)
            checkpoint_wrapper(layer, policy, swap_inputs=swap_inputs)
    return model
