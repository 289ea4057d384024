"""Chunked linear + cross-entropy for training, as a pass on Inductor's joint forward+backward
graph (``torch._inductor.config.joint_custom_pre_pass``).

A causal LM's loss ``F.cross_entropy(lm_head(h), labels)`` materialises ``[tokens, vocab]``
logits and autograd saves their log-softmax for backward: 8k tokens x 152k vocab in fp32 is
5 GB, more than every other activation. Post-grad passes run after AOTAutograd's partitioner has
decided what is saved, too late to change it; in the joint graph the forward and backward are
still one graph, so the pass replaces the head GEMM, log-softmax and NLL (forward) and the NLL and
log-softmax backward with the head's gradient GEMMs (backward) by ``npu_core::chunked_ce_forward``
and ``npu_core::chunked_ce_backward`` (:mod:`npu_core.chunked_ce`, which computes them; this module
only matches and rewrites). The partitioner that runs next saves only the hidden states, the
weight, the targets and a ``[tokens]`` log-sum-exp.

What is matched is the joint graph as Inductor's decompositions spell it (``log_softmax`` as
amax/sub/exp/sum/log/sub, ``nll_loss_forward`` as gather/where/sum/div by the valid count, their
backward as scatter/where/mul/exp/sum/sub): every node is checked, and every intermediate must be
used only inside the pattern (so the logits' gradient is exactly the loss's). Refused with a
reason: reduction other than mean, class weights, label smoothing or any other use of the
log-probabilities or logits (returned logits, z-loss), a head that is not one 2-D GEMM, dtypes
other than fp32 (not measured), no backward (inference), and logits that fit one chunk (nothing
to save). Trade: the head's forward GEMM runs once more (in backward), i.e. 4 head GEMMs instead
of 3, for peak memory that no longer grows with ``tokens x vocab``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import operator
import sys
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from mfusion.config import MFusionConfig
from mfusion.passes._graph import (
    CONVERT,
    aten,
    fake_mode_of,
    int_list,
    is_op,
    op_counts,
    tensor_val,
)
from mfusion.passes.base import Refusal
from mfusion.report import Decision, GraphReport, new_graph_report
from npu_core import chunked_ce

NAME = "chunked_cross_entropy"
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk of fp32 logits takes at most ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab))


@dataclasses.dataclass
class _Match:
    """The nodes a rewrite reads and replaces."""

    hidden: fx.Node
    weight_t: fx.Node
    bias: fx.Node | None
    target: fx.Node
    ignore_index: int
    loss: fx.Node
    grad_loss: fx.Node
    grad_hidden: fx.Node | None  # mm(grad_logits, weight_t^T): [N, H]
    grad_weight: fx.Node | None  # mm(grad_logits^T, hidden): [V, H]
    grad_bias: fx.Node | None  # sum(grad_logits, [0], keepdim=True): [1, V]
    owned: set[fx.Node]  # every node whose value the pattern computes
    rows: int
    vocab: int


def _single(node: fx.Node, what: str) -> fx.Node:
    users = list(node.users)
    if len(users) != 1:
        raise Refusal(f"{what} has {len(users)} users, expected 1")
    return users[0]


def _user(node: fx.Node, *targets: object) -> fx.Node | None:
    return next((u for u in node.users if is_op(u, *targets)), None)


def _through_views(node: Any) -> Any:
    """The node below any chain of views/aliases."""
    while is_op(node, *VIEWS):
        node = node.args[0]
    return node


def _view_closure(node: fx.Node) -> set[fx.Node]:
    """``node`` and every view/alias of it (transitively)."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in found:
            continue
        found.add(current)
        stack.extend(u for u in current.users if is_op(u, *VIEWS))
    return found


def _is_zero_scalar(node: object) -> bool:
    return is_op(node, aten.scalar_tensor.default) and int_list(node.args[0]) == [0]


def _valid_mask_of(node: object) -> tuple[fx.Node, int] | None:
    """``(target, ignore_index)`` for ``ne(target, ignore_index)``."""
    if is_op(node, aten.ne.Scalar) and isinstance(node.args[1], int):
        target = node.args[0]
        assert isinstance(target, fx.Node)
        return target, node.args[1]
    return None


def _masked(node: object, target: fx.Node, ignore: int) -> object | None:
    """``x`` for ``where(ne(target, ignore), x, 0)``; None otherwise."""
    if not is_op(node, aten.where.self) or not _is_zero_scalar(node.args[2]):
        return None
    return node.args[1] if _valid_mask_of(node.args[0]) == (target, ignore) else None


def _head(logits: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, fx.Node, set[fx.Node]]:
    """``(hidden, weight_t, bias, gemm, view nodes)`` of logits computed by one 2-D GEMM."""
    gemm = _through_views(logits)
    if is_op(gemm, CONVERT):
        raise Refusal("logits are cast before the loss (low-precision head): not measured")
    if is_op(gemm, aten.mm.default):
        hidden, weight_t, bias = gemm.args[0], gemm.args[1], None
    elif is_op(gemm, aten.addmm.default) and len(gemm.args) == 3 and not gemm.kwargs:
        bias, hidden, weight_t = gemm.args
        bias_val = tensor_val(bias)
        if bias_val is None or bias_val.dim() != 1:
            raise Refusal("addmm bias is not a [vocab] vector")
    else:
        raise Refusal(f"logits come from {getattr(gemm, 'target', gemm)}, not one 2-D GEMM")
    assert isinstance(hidden, fx.Node) and isinstance(weight_t, fx.Node)
    views = set()
    node: Any = logits
    while node is not gemm:
        views.add(node)
        node = node.args[0]
    if tensor_val(logits) is None or tensor_val(gemm).shape != tensor_val(logits).shape:  # type: ignore[union-attr]
        raise Refusal("the GEMM's rows are reshaped before the loss")
    return hidden, weight_t, bias if isinstance(bias, fx.Node) else None, gemm, views


def match_forward(amax: fx.Node) -> dict[str, Any] | None:
    """The forward half anchored at ``amax(logits, [1], keepdim)``: None if not a log-softmax,
    :class:`Refusal` if a log-softmax + NLL whose rewrite would not be exact."""
    if (
        not is_op(amax, aten.amax.default)
        or int_list(amax.args[1]) != [1]
        or amax.args[2] is not True
    ):
        return None
    logits = amax.args[0]
    assert isinstance(logits, fx.Node)
    shift = _user(amax, aten.sub.Tensor)
    exp = _user(shift, aten.exp.default) if shift is not None else None
    total = _user(exp, aten.sum.dim_IntList) if exp is not None else None
    log = _user(total, aten.log.default) if total is not None else None
    logp = _user(log, aten.sub.Tensor) if log is not None else None
    if shift is None or logp is None or shift.args != (logits, amax) or logp.args != (shift, log):
        return None
    value = tensor_val(logits)
    if value is None or value.dim() != 2:
        return None
    gather = _user(logp, aten.gather.default)
    if gather is None:
        raise Refusal("log-probabilities do not feed gather(logp, 1, targets) (class weights?)")
    for user in logp.users:
        if user is not gather and not is_op(user, *VIEWS):
            raise Refusal(
                f"log-probabilities are also used outside the loss, by {user.target} (label "
                "smoothing, another loss term)"
            )
    index = gather.args[2]
    if gather.args[1] != 1 or not is_op(index, aten.unsqueeze.default):
        raise Refusal("gather is not over the class dim")
    valid = index.args[0]
    mask = _valid_mask_of(valid.args[0]) if is_op(valid, aten.where.self) else None
    if mask is None or _masked(valid, *mask) is not mask[0]:
        raise Refusal("targets are not masked by ignore_index")
    target, ignore = mask
    squeeze = _single(gather, "gather")
    neg = _single(squeeze, "the gathered log-probability")
    if not is_op(neg, aten.neg.default):
        raise Refusal(f"gathered log-probability feeds {neg.target} (class weights?)")
    masked = _single(neg, "-log-probability")
    if _masked(masked, target, ignore) is not neg:
        raise Refusal("per-token loss is not masked by ignore_index")
    summed = _single(masked, "per-token loss")
    if not is_op(summed, aten.sum.default):
        raise Refusal("reduction='none': the per-token loss is not summed")
    loss = _single(summed, "summed loss")
    count = loss.args[1] if is_op(loss, aten.div.Tensor) and loss.args[0] is summed else None
    counted = count.args[0] if is_op(count, CONVERT) else None
    if not is_op(counted, aten.sum.default) or _valid_mask_of(counted.args[0]) != mask:
        raise Refusal("reduction is not 'mean' (the summed loss is not divided by the valid count)")
    if tensor_val(logits).dtype != torch.float32:  # type: ignore[union-attr]
        raise Refusal(f"logits are {tensor_val(logits).dtype}: only fp32 is measured")  # type: ignore[union-attr]
    hidden, weight_t, bias, gemm, views = _head(logits)
    pattern = (amax, shift, exp, total, log, logp, gather, squeeze, neg, masked, summed, gemm)
    owned = {n for n in pattern if n is not None} | views
    _check_closed(owned | {loss}, {loss, logp})  # logp's aliases feed the backward
    return {
        "hidden": hidden,
        "weight_t": weight_t,
        "bias": bias,
        "target": target,
        "ignore": ignore,
        "loss": loss,
        "count": count,
        "logits": logits,
        "logp": logp,
        "owned": owned,
    }


def match_backward(fwd: dict[str, Any]) -> dict[str, Any]:
    """The backward half: NLL and log-softmax backward and the head's gradient GEMMs."""
    count, target, ignore = fwd["count"], fwd["target"], fwd["ignore"]
    scaled = [u for u in count.users if u is not fwd["loss"]]
    if not scaled:
        raise Refusal("no backward in this graph (inference): nothing is saved to avoid")
    if len(scaled) != 1 or not is_op(scaled[0], aten.div.Tensor) or scaled[0].args[1] is not count:
        raise Refusal("the valid count is used outside the NLL backward")
    scaled_grad = scaled[0]
    grad_loss = scaled_grad.args[0]
    masked_grad = _single(scaled_grad, "grad / count")
    mul = _single(masked_grad, "masked grad")
    if not is_op(masked_grad, aten.where.self) or not is_op(mul, aten.mul.Tensor):
        raise Refusal("NLL backward is not where(valid, grad / count, 0) * onehot")
    mask = masked_grad.args[0]
    unsq = mask.args[0] if is_op(mask, aten.ne.Scalar) and mask.args[1] == ignore else None
    if not is_op(unsq, aten.unsqueeze.default) or unsq.args[0] is not target:
        raise Refusal("NLL backward masks other targets")
    if _masked(masked_grad, unsq, ignore) is not scaled_grad:
        raise Refusal("NLL backward mask differs")
    scatter = mul.args[0] if mul.args[1] is masked_grad else mul.args[1]
    if not (
        is_op(scatter, aten.scatter.value)
        and scatter.args[1] == 1
        and scatter.args[3] == -1.0
        and is_op(scatter.args[0], aten.full.default)
        and scatter.args[0].args[1] == 0
        and _masked(scatter.args[2], unsq, ignore) is unsq
    ):
        raise Refusal("NLL backward is not a -1 scattered at the targets")
    row_sum = _user(mul, aten.sum.dim_IntList)
    grad = _user(mul, aten.sub.Tensor)
    if row_sum is None or grad is None or len(mul.users) != 2:
        raise Refusal("log-softmax backward does not read the NLL gradient as expected")
    prob_mul = grad.args[1]
    if grad.args[0] is not mul or not is_op(prob_mul, aten.mul.Tensor):
        raise Refusal("log-softmax backward is not g - exp(logp) * sum(g)")
    prob = prob_mul.args[0] if prob_mul.args[1] is row_sum else prob_mul.args[1]
    if not is_op(prob, aten.exp.default) or _through_views(prob.args[0]) is not fwd["logp"]:
        raise Refusal("log-softmax backward does not exponentiate the saved log-probabilities")
    owned = {scaled_grad, masked_grad, mul, scatter, row_sum, grad, prob_mul, prob}
    owned |= _view_closure(fwd["logp"]) - {fwd["logp"]}
    gemms = _gradient_gemms(grad, fwd)
    return {**gemms, "grad_loss": grad_loss, "owned": owned | gemms["owned"]}


def _gradient_gemms(grad: fx.Node, fwd: dict[str, Any]) -> dict[str, Any]:
    """The head's gradient GEMMs reading the logits' gradient (through views)."""
    hidden, weight_t, bias = fwd["hidden"], fwd["weight_t"], fwd["bias"]
    views = _view_closure(grad)
    found: dict[str, Any] = {"grad_hidden": None, "grad_weight": None, "grad_bias": None}
    transposes = set()
    for view in views:
        for user in view.users:
            if user in views:
                continue
            if is_op(user, aten.mm.default) and user.args[0] is view:
                other = user.args[1]
                if is_op(other, aten.permute.default) and other.args[0] is weight_t:
                    found["grad_hidden"] = user
                    continue
            if is_op(user, aten.permute.default) and int_list(user.args[1]) == [1, 0]:
                gemm = _single(user, "the transposed logits gradient")
                if is_op(gemm, aten.mm.default) and gemm.args == (user, hidden):
                    found["grad_weight"] = gemm
                    transposes.add(user)
                    continue
            if (
                bias is not None
                and is_op(user, aten.sum.dim_IntList)
                and int_list(user.args[1]) == [0]
                and user.args[2] is True
            ):
                found["grad_bias"] = user
                continue
            raise Refusal(f"the logits' gradient also feeds {user.target} ({user.name})")
    if found["grad_hidden"] is None and found["grad_weight"] is None:
        raise Refusal("neither the hidden states nor the head weight need a gradient")
    found["owned"] = views | transposes
    return found


def _check_closed(owned: set[fx.Node], outputs: set[fx.Node]) -> None:
    """Every value the pattern computes, except its outputs, is used inside it only."""
    for node in owned - outputs:
        for user in node.users:
            if user not in owned:
                raise Refusal(
                    f"{node.name} ({node.target}) is also used by {user.name} ({user.target}): "
                    "the logits or log-probabilities are used outside the loss (returned logits, "
                    "label smoothing, another loss term)"
                )


def match(amax: fx.Node, chunk_bytes: int) -> _Match | None:
    """The whole pattern anchored at a log-softmax's amax; None or :class:`Refusal`."""
    fwd = match_forward(amax)
    if fwd is None:
        return None
    bwd = match_backward(fwd)
    outputs = {fwd["loss"], *(bwd[k] for k in ("grad_hidden", "grad_weight", "grad_bias"))}
    owned = fwd["owned"] | bwd["owned"] | {fwd["loss"]} | outputs - {None}
    _check_closed(owned, outputs)
    rows, vocab = tensor_val(fwd["logits"]).shape  # type: ignore[union-attr]
    if not isinstance(rows, int) or not isinstance(vocab, int):
        raise Refusal("symbolic shapes")
    if rows * vocab * 4 <= chunk_bytes:
        raise Refusal(
            f"logits [{rows}, {vocab}] fp32 ({rows * vocab * 4} B) fit one chunk of "
            f"{chunk_bytes} B: nothing to save"
        )
    return _Match(
        hidden=fwd["hidden"],
        weight_t=fwd["weight_t"],
        bias=fwd["bias"],
        target=fwd["target"],
        ignore_index=fwd["ignore"],
        loss=fwd["loss"],
        grad_loss=bwd["grad_loss"],
        grad_hidden=bwd["grad_hidden"],
        grad_weight=bwd["grad_weight"],
        grad_bias=bwd["grad_bias"],
        owned=owned,
        rows=rows,
        vocab=vocab,
    )


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """Insert an opaque call (a custom op or getitem/view) with its fake value."""
    node = graph.call_function(target, args)
    mode = fake_mode_of(graph)
    fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*fake_args)
    node.meta["mfusion"] = NAME
    return node


def rewrite(found: _Match, chunk_bytes: int) -> str:
    """Replace the loss and the head's gradients by the chunked ops; returns what it became."""
    graph = found.loss.graph
    rows = chunk_rows(found.vocab, chunk_bytes)
    # the ops' options after the tensors: mean reduction (matched), no softcap
    options = (found.ignore_index, "mean", None, rows)
    with graph.inserting_before(found.loss):
        weight = _call(graph, aten.permute.default, found.weight_t, [1, 0])  # [V, H], a view
        common = (found.hidden, weight, found.bias, found.target)
        fwd = _call(graph, torch.ops.npu_core.chunked_ce_forward.default, *common, *options)
        loss = _call(graph, operator.getitem, fwd, 0)
        lse = _call(graph, operator.getitem, fwd, 1)
    found.loss.replace_all_uses_with(loss)
    order = {node: i for i, node in enumerate(graph.nodes)}
    consumers = [n for n in (found.grad_hidden, found.grad_weight, found.grad_bias) if n]
    first = min(consumers, key=order.__getitem__)
    with graph.inserting_before(first):
        bwd = _call(graph, torch.ops.npu_core.chunked_ce_backward.default,
                    found.grad_loss, *common, lse, *options, found.grad_hidden is not None,
                    found.grad_weight is not None, found.grad_bias is not None)  # fmt: skip
        for index, old in enumerate((found.grad_hidden, found.grad_weight, found.grad_bias)):
            if old is None:
                continue
            new = _call(graph, operator.getitem, bwd, index)
            if index == 2:  # sum(grad, [0], keepdim=True) is [1, V]
                new = _call(graph, aten.view.default, new, [1, found.vocab])
            old.replace_all_uses_with(new)
    graph.eliminate_dead_code()
    return (
        f"chunked linear + cross-entropy ([{found.rows}, {found.vocab}] logits in chunks of "
        f"{rows} rows, ignore_index {found.ignore_index}, bias {found.bias is not None})"
    )


class ChunkedCrossEntropyPass(CustomGraphPass):
    """Inductor's joint-graph custom pass: rewrites every matched linear + cross-entropy and
    records each rewrite or refusal in mfusion's report (one entry per joint graph)."""

    def __init__(self, config: MFusionConfig) -> None:
        self.config = config

    def __call__(self, graph: fx.Graph) -> None:
        self.run(graph)

    def run(self, graph: fx.Graph) -> GraphReport:
        record = new_graph_report("joint")
        record.ops_before = op_counts(graph)
        budget = self.config.chunked_cross_entropy_bytes
        for node in list(graph.nodes):
            if node.graph is not graph or not is_op(node, aten.amax.default):
                continue
            try:
                found = match(node, budget)
            except Refusal as refusal:
                record.decisions.append(Decision(NAME, node.name, False, str(refusal)))
                continue
            if found is not None:
                record.decisions.append(Decision(NAME, node.name, True, rewrite(found, budget)))
        record.ops_after = op_counts(graph)
        return record

    def uuid(self) -> str:
        """Hash of this module, the ops' module and the settings that change the rewrite."""
        digest = hashlib.sha256()
        for module in (__name__, chunked_ce.__name__):
            digest.update(inspect.getsource(sys.modules[module]).encode())
        digest.update(str(self.config.chunked_cross_entropy_bytes).encode())
        return digest.hexdigest()
