"""FSDP2 / HSDP for the MoE transformer: one ``fully_shard`` per block, then the root."""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from hyperparallel.activation import checkpoint_wrapper, resolve

_MESH = re.compile(r"^(?:(fsdp)|(\d+)x(\d+))$")


def parse_mesh(mesh: str, world_size: int) -> tuple[int, ...]:
    """``"fsdp"`` -> ``(world,)``; ``"RxS"`` -> HSDP with R replica groups of S shards.

    Raises:
        ValueError: unknown form, or a shape whose product is not the world size.
    """
    match = _MESH.match(mesh.strip().lower())
    if not match:
        raise ValueError(f"--mesh {mesh!r}: use 'fsdp' or 'RxS' (e.g. '2x2' for HSDP)")
    if match.group(1):
        return (world_size,)
    shape = (int(match.group(2)), int(match.group(3)))
    if shape[0] * shape[1] != world_size or min(shape) < 1:
        raise ValueError(
            f"--mesh {mesh}: {shape[0]} x {shape[1]} ranks != world size {world_size}; "
            f"choose R x S with R * S = {world_size}"
        )
    return shape


def build_mesh(shape: tuple[int, ...], device_type: str) -> DeviceMesh:
    """A 1-D ``("shard",)`` mesh for FSDP2 or a 2-D ``("replicate", "shard")`` one for HSDP."""
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard every block, then the rest (embedding, final norm, head) at the root.

    On a 2-D mesh fully_shard is HSDP: parameters are replicated over the first mesh dimension
    and sharded over the second.
    """
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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
    for i, layer in enumerate(model.layers):
        name = policies[min(i, len(policies) - 1)]
        if name != "none":
            policy = resolve(name, swap_threshold_bytes)
            checkpoint_wrapper(layer, policy, swap_inputs=swap_inputs)
    return model
