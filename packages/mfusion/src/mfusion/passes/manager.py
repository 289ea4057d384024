"""The pass manager is itself Inductor's post-grad custom pass: it runs the configured rewrites,
automatic fusion, then cleanup, and hashes everything that decides its output into ``uuid()``."""

from __future__ import annotations

import functools
import hashlib
import importlib
import time
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

from mfusion.config import MFusionConfig
from mfusion.passes._graph import op_counts
from mfusion.passes.base import MFusionPass, PassContext
from mfusion.passes.cleanup import cleanup
from mfusion.passes.registry import PASS_REGISTRY
from mfusion.report import GraphReport, new_graph_report


@functools.cache
def package_source_hash() -> str:
    """SHA-256 over every Python file of the installed mfusion package (path and contents)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_pass(name: str) -> MFusionPass:
    """Instantiate the pass registered under ``name`` in :data:`PASS_REGISTRY`.

    Raises:
        ValueError: ``name`` is not registered (the message lists the registered names).
    """
    try:
        location = PASS_REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"pass {name!r} is not known; available passes: {sorted(PASS_REGISTRY)}"
        ) from None
    module, attr = location.split(":")
    graph_pass = getattr(importlib.import_module(module), attr)()
    if not isinstance(graph_pass, MFusionPass):
        raise TypeError(f"pass {name!r} is registered as {location}, not an MFusionPass")
    return graph_pass


class MFusionPassManager(CustomInferenceAwareGraphPass):
    """Runs mfusion on each post-grad graph Inductor compiles.

    Inference-aware: Inductor tells it whether the graph is an inference graph or the forward or
    backward of a training step (``conv_layout`` times the backward too when one follows).

    Args:
        config: What to run; see :class:`~mfusion.config.MFusionConfig`.
    """

    def __init__(self, config: MFusionConfig | None = None) -> None:
        self.config = config or MFusionConfig()
        names = self.config.passes if self.config.passes is not None else tuple(PASS_REGISTRY)
        self.passes = [build_pass(name) for name in names]

    # Inductor's inference-aware interface adds the flag to the base class's signature.
    def __call__(self, graph: fx.Graph, is_inference: bool) -> None:  # type: ignore[override]
        self.run(graph, is_inference)

    def run(self, graph: fx.Graph, is_inference: bool | None = None) -> GraphReport:
        """Rewrite ``graph`` in place and return (and record) what happened.

        ``is_inference``: whether no backward follows (Inductor says); None when unknown, and
        the passes that need to know refuse."""
        backend = self.config.resolved_backend()
        # Decide every machine-dependent rewrite of this graph for one profile, detected once.
        machine = self.config.resolved_machine()
        config = self.config.model_copy(update={"machine": machine})
        record = new_graph_report(backend.value)
        record.machine = machine.describe()
        record.ops_before = op_counts(graph)
        ctx = PassContext(config, record, is_inference)
        for graph_pass in self.passes:
            start = time.perf_counter()
            graph_pass(graph, ctx)
            cleanup(graph)
            record.pass_seconds[graph_pass.name] = time.perf_counter() - start
        if self.config.auto_fuse:
            from mfusion.autofuse.fuse import auto_fuse

            start = time.perf_counter()
            auto_fuse(graph, config, record)
            record.pass_seconds["auto_fuse"] = time.perf_counter() - start
        cleanup(graph)
        record.ops_after = op_counts(graph)
        return record

    def uuid(self) -> str:
        """Hash of the package source and of every setting that changes the rewritten graph,
        including the machine profile the machine-dependent rewrites decide for (so a graph
        compiled on one CPU, ISA cap or thread count is not served on another)."""
        digest = hashlib.sha256()
        digest.update(package_source_hash().encode())
        digest.update(self.config.fingerprint().encode())
        for graph_pass in self.passes:
            digest.update(graph_pass.uuid().encode())
        return digest.hexdigest()
