"""Base class of the hand-written passes: source-hashed uuid, per-match decisions, timing."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import sys
from collections.abc import Callable
from typing import ClassVar

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import live_nodes
from mfusion.report import Decision, GraphReport


@dataclasses.dataclass
class PassContext:
    """What a pass sees besides the graph: settings and the report it writes decisions into."""

    config: MFusionConfig
    record: GraphReport
    is_inference: bool | None = None
    """Whether no backward follows this graph; None when the caller did not say."""

    def rewrote(self, pass_name: str, node: fx.Node, detail: str) -> None:
        self.record.decisions.append(Decision(pass_name, node.name, True, detail))

    def refused(self, pass_name: str, node: fx.Node, reason: str) -> None:
        self.record.decisions.append(Decision(pass_name, node.name, False, reason))


Rewrite = Callable[[], str]
"""Performs a matched rewrite at the graph's insertion point and returns what it became."""


class Refusal(Exception):
    """Raised by a matcher when a pattern is recognised but unsafe to rewrite."""


class MFusionPass:
    """A graph rewrite on Inductor's post-grad FX graph.

    Subclasses set ``name`` and implement :meth:`match_at`, which looks at one anchor node and
    returns None (not this pattern), raises :class:`Refusal` (this pattern, but a check on dtype,
    shape or numerics failed), or returns a callable that performs the rewrite and describes it.
    """

    name: ClassVar[str]

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> None:
        for node in live_nodes(graph):
            # Skip nodes erased by an earlier rewrite and nodes a pass already emitted.
            if node.graph is not graph or "mfusion" in node.meta:
                continue
            try:
                rewrite = self.match_at(node, ctx.config)
            except Refusal as refusal:
                ctx.refused(self.name, node, str(refusal))
                continue
            if rewrite is not None:
                first_new = node.prev
                with graph.inserting_before(node):
                    ctx.rewrote(self.name, node, rewrite())
                _tag_inserted(first_new, node, self.name)

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        """None (no match), :class:`Refusal` (unsafe match) or the :data:`Rewrite` to run."""
        raise NotImplementedError

    @classmethod
    def uuid(cls) -> str:
        """Hash of the source of the module defining the pass: editing a pass invalidates caches."""
        source = inspect.getsource(sys.modules[cls.__module__])
        return hashlib.sha256(source.encode()).hexdigest()


def _tag_inserted(before: fx.Node, anchor: fx.Node, pass_name: str) -> None:
    """Mark nodes emitted by a rewrite so no pass matches its own output again."""
    node = before.next
    while node is not anchor and node.op != "root":
        node.meta["mfusion"] = pass_name
        node = node.next
