"""Fixtures shared by hyperparallel's tests (given as fixtures: no test imports another)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from npu_core.run_record import RunRecord
from packages.hyperparallel.tests.tiny_hf import TINY_HF_SHAPE

# Measured decisions (Newton-Schulz strategy, fast bf16 GEMMs) take their documented fallbacks in
# tests, ranks included (they inherit the environment): no outcome depends on this machine's
# speed, and nothing is written to the user's cache. Tests of a measurement inject a timer.
os.environ.setdefault("NPU_CORE_DECISIONS", "fallback")
os.environ.setdefault("NPU_CORE_CACHE_DIR", tempfile.mkdtemp(prefix="hyperparallel-decisions-"))


@pytest.fixture
def snapshot() -> Callable[[Path], dict[Path, bytes]]:
    """Every file under a folder with its bytes, to show that a refused run changed nothing."""

    def files(folder: Path) -> dict[Path, bytes]:
        return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    return files


@pytest.fixture
def earlier_run(snapshot) -> Callable[[Path], dict[Path, bytes]]:
    """Make a folder look like a finished ``hyperparallel train`` run (its artefacts, recorded
    as the job records them) plus a user's own file."""

    def make(folder: Path) -> dict[Path, bytes]:
        RunRecord(folder).claim(["metrics.json", "loss.png", "checkpoints", "logs"])
        (folder / "checkpoints" / "step_0000010").mkdir(parents=True)
        (folder / "checkpoints" / "latest").write_text("step_0000010")
        (folder / "metrics.json").write_text('{"train": []}')
        (folder / "notes.txt").write_text("the user's own file")
        return snapshot(folder)

    return make


@pytest.fixture
def tiny_hf_shape() -> dict[str, int]:
    """A transformers config shape small enough for a CPU test step (a fresh copy per test):
    each family test adds its own MoE / MLA fields on top."""
    return dict(TINY_HF_SHAPE)


def _torch_optimizer_step(
    model: nn.Module, grads: dict[str, torch.Tensor], muon: dict, adamw: dict
) -> dict[str, torch.Tensor]:
    """``model``'s weights (copied, the model is unchanged) stepped once with ``grads`` by
    torch.optim.Muon (adjust_lr_fn="original"; each expert of a ``[E, M, N]`` stack its own
    matrix) and torch.optim.AdamW, routed by ``model.routing()`` (a CausalLM)."""
    routing = model.routing()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    views, leaves = [], []
    for name in routing.muon:
        stack, grad = params[name], grads[name]
        if stack.ndim == 2:
            stack, grad = stack[None], grad[None]
        for view, g in zip(stack.unbind(0), grad.unbind(0), strict=True):
            leaf = view.clone().requires_grad_()
            leaf.grad = g
            views.append(view)
            leaves.append(leaf)
    torch.optim.Muon(leaves, adjust_lr_fn="original", **muon).step()
    for view, leaf in zip(views, leaves, strict=True):
        view.copy_(leaf.detach())  # writes back into the stacks
    stepped = [params[n].requires_grad_() for n in routing.adamw]
    for p, name in zip(stepped, routing.adamw, strict=True):
        p.grad = grads[name]
    torch.optim.AdamW(stepped, **adamw).step()
    return {n: p.detach() for n, p in params.items()}


@pytest.fixture
def torch_optimizer_step() -> Callable[..., dict[str, torch.Tensor]]:
    """The independent reference of one hyperparallel Muon + AdamW step (see the helper)."""
    return _torch_optimizer_step


class MixedShapes(nn.Module):
    """Mixed shapes for distributed Muon: uneven rows (5 and 3 on 4 ranks leave empty shards),
    experts ``[4, 6, 5]``, a conv weight. Module-level so that ranks unpickle it by name."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 16, bias=False)
        self.b = nn.Linear(16, 5, bias=False)
        self.c = nn.Linear(5, 3, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 6, 5))
        self.conv = nn.Conv2d(2, 6, 3, bias=False)

    def random_grads(self, step: int) -> list[torch.Tensor]:
        """Gradients for ``step``, the same on every rank (seeded by the step alone)."""
        generator = torch.Generator().manual_seed(100 + step)
        return [torch.randn(p.shape, generator=generator) for p in self.parameters()]


@pytest.fixture
def mixed_shapes() -> type[MixedShapes]:
    """The :class:`MixedShapes` model class; pass it to the rank functions (launch arguments)."""
    return MixedShapes


class ProcessTree:
    """Live processes below a pid, read from Linux ``/proc`` (no psutil), to show that a failed or
    signalled run leaves no rank, forkserver or helper process behind."""

    @staticmethod
    def children() -> dict[int, list[int]]:
        """Parent pid -> its children's pids, over every process now in ``/proc``."""
        found: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        return found

    def descendants(self, pid: int) -> set[int]:
        """Every process below ``pid``."""
        children, found, todo = self.children(), set(), [pid]
        while todo:
            for child in children.get(todo.pop(), []):
                found.add(child)
                todo.append(child)
        return found

    @staticmethod
    def alive(pid: int) -> bool:
        """Running or sleeping (a zombie awaiting its parent counts as gone)."""
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"


@pytest.fixture
def process_tree() -> ProcessTree:
    """:class:`ProcessTree`; tests using it skip where there is no ``/proc``."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("counts processes via /proc")
    return ProcessTree()
