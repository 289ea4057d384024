"""Chunked linear + cross-entropy (joint-graph pass): loss and every gradient equal eager, the
backward no longer receives a [tokens, vocab] tensor, near misses refused with reasons."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import mfusion
from mfusion.joint.chunked_ce import NAME, chunk_rows

VOCAB, WIDTH = 40, 16
TOKENS = (2, 9)  # 18 rows: not a multiple of the 5-row chunks below
CHUNK_BYTES = 4 * VOCAB * 5  # five rows of fp32 logits per chunk


class GraphInputs(CustomGraphPass):
    """Records the shapes of every post-grad graph's inputs (Inductor's pre-pass hook, which
    mfusion leaves free): the backward graph's inputs are what the forward saved for it."""

    def __init__(self) -> None:
        self.graphs: list[list[tuple[str, tuple[int, ...]]]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(
            [
                (n.name, tuple(n.meta["val"].shape))
                for n in graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
            ]
        )

    def saved_for_backward(self) -> list[tuple[int, ...]]:
        (backward,) = [g for g in self.graphs if any(n.startswith("tangents") for n, _ in g)]
        return [shape for name, shape in backward if not name.startswith("tangents")]

    def uuid(self) -> str:
        return "record-graph-inputs"


@pytest.fixture
def graph_inputs():
    recorder = GraphInputs()
    inductor_config.post_grad_custom_pre_pass = recorder
    try:
        yield recorder
    finally:
        inductor_config.post_grad_custom_pre_pass = None


class LinearLoss(torch.nn.Module):
    """An LM head and its loss, written the plain way."""

    def __init__(self, bias: bool, **loss_options: object) -> None:
        super().__init__()
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=bias)
        self.loss_options = loss_options

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).view(-1, VOCAB)
        return F.cross_entropy(logits, target.view(-1), **self.loss_options)  # type: ignore[arg-type]


def _targets(shape: tuple[int, ...], vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    target = torch.randint(0, vocab, shape, generator=gen)
    target.view(-1)[::4] = -100  # ignored positions, including the first row of a chunk
    return target


def _grads(model: torch.nn.Module, loss: torch.Tensor, *inputs: torch.Tensor) -> list:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, [*inputs, *params]))


def _compile(model: torch.nn.Module, **options: object) -> object:
    torch._dynamo.reset()
    # the joint pass alone: the post-grad passes and auto-fusion have their own tests
    options = {"backend": "inductor", "passes": (), "auto_fuse": False, **options}
    return torch.compile(model, options=mfusion.compile_options(**options))


def _logits_shaped(shapes: list[tuple[int, ...]], rows: int, vocab: int) -> list:
    """The shapes holding one value per (token, class): [tokens, vocab] in any view."""
    return [s for s in shapes if s[-1:] == (vocab,) and torch.Size(s).numel() == rows * vocab]


def _decisions() -> list:
    return [d for g in mfusion.report() for d in g.decisions if d.pass_name == NAME]


def test_chunk_rows_bound_one_chunk_of_logits():
    assert chunk_rows(32000, 64 << 20) == (64 << 20) // (4 * 32000)
    assert chunk_rows(200_000, 1024) == 1  # never zero rows


@pytest.mark.slow
@pytest.mark.parametrize("bias", [False, True], ids=["mm", "addmm"])
def test_linear_cross_entropy_equals_eager_and_saves_no_logits(bias, graph_inputs):
    torch.manual_seed(0)
    model = LinearLoss(bias)
    hidden = torch.randn(*TOKENS, WIDTH, requires_grad=True)
    target = _targets(TOKENS, VOCAB)
    expected_loss = model(hidden, target)
    expected = _grads(model, expected_loss, hidden)
    rows = TOKENS[0] * TOKENS[1]

    plain = _compile(model)
    _grads(model, plain(hidden, target), hidden)
    assert _logits_shaped(graph_inputs.saved_for_backward(), rows, VOCAB)  # what the pass is for

    mfusion.clear_report()
    graph_inputs.graphs.clear()
    compiled = _compile(model, chunked_cross_entropy=True, chunked_cross_entropy_bytes=CHUNK_BYTES)
    loss = compiled(hidden, target)
    grads = _grads(model, loss, hidden)
    torch.testing.assert_close(loss, expected_loss)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)
    (decision,) = _decisions()
    assert decision.rewritten and "chunks of 5 rows" in decision.reason, decision
    saved = graph_inputs.saved_for_backward()
    assert not _logits_shaped(saved, rows, VOCAB), saved
    assert (rows,) in saved  # the log-sum-exp


@pytest.mark.slow
def test_llama_own_loss_equals_eager_and_saves_no_logits(graph_inputs):
    """LlamaForCausalLM computing its own shifted, ignore_index loss from labels."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 96, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on

    class LossOnly(torch.nn.Module):
        """Returns the loss alone: logits that leave the graph cannot be chunked away."""

        def __init__(self) -> None:
            super().__init__()
            self.lm = model

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids, labels=labels).loss

    wrapper = LossOnly()
    expected_loss = wrapper(ids, labels)
    expected = _grads(wrapper, expected_loss)
    compiled = _compile(wrapper, chunked_cross_entropy=True, chunked_cross_entropy_bytes=4 * 96 * 4)
    loss = compiled(ids, labels)
    grads = _grads(wrapper, loss)
    torch.testing.assert_close(loss, expected_loss)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    (decision,) = _decisions()
    assert decision.rewritten, decision
    rows = 2 * 9
    assert not _logits_shaped(graph_inputs.saved_for_backward(), rows, 96)


REFUSALS = [
    ({"label_smoothing": 0.1}, "used outside the loss"),
    ({"reduction": "sum"}, "reduction is not 'mean'"),
    ({"reduction": "none"}, "reduction='none'"),
    ({"weight": torch.rand(VOCAB) + 0.5}, "class weights"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_options", "reason"), REFUSALS, ids=[reason for _, reason in REFUSALS]
)
def test_other_cross_entropies_are_refused_and_stay_exact(loss_options, reason):
    torch.manual_seed(0)
    model = LinearLoss(True, **loss_options)
    hidden = torch.randn(*TOKENS, WIDTH, requires_grad=True)
    target = _targets(TOKENS, VOCAB)
    expected_loss = model(hidden, target)
    compiled = _compile(model, chunked_cross_entropy=True, chunked_cross_entropy_bytes=CHUNK_BYTES)
    loss = compiled(hidden, target)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(
        _grads(model, loss.sum(), hidden)[0], _grads(model, expected_loss.sum(), hidden)[0]
    )
    decisions = _decisions()
    assert decisions and not any(d.rewritten for d in decisions)
    assert any(reason in d.reason for d in decisions), decisions


@pytest.mark.slow
def test_returned_logits_and_small_logits_and_inference_are_refused():
    torch.manual_seed(0)
    model = LinearLoss(False)
    hidden = torch.randn(*TOKENS, WIDTH, requires_grad=True)
    target = _targets(TOKENS, VOCAB)

    def loss_and_logits(hidden: torch.Tensor, target: torch.Tensor) -> tuple:
        logits = model.head(hidden).view(-1, VOCAB)
        return F.cross_entropy(logits, target.view(-1)), logits

    torch._dynamo.reset()
    options = mfusion.compile_options(
        backend="inductor",
        passes=(),
        auto_fuse=False,
        chunked_cross_entropy=True,
        chunked_cross_entropy_bytes=CHUNK_BYTES,
    )
    loss, _ = torch.compile(loss_and_logits, options=options)(hidden, target)
    torch.testing.assert_close(loss, loss_and_logits(hidden, target)[0])
    (returned,) = _decisions()
    assert not returned.rewritten and "used outside the loss" in returned.reason

    mfusion.clear_report()
    _compile(model, chunked_cross_entropy=True)(hidden, target)  # 64 MiB budget
    (small,) = _decisions()
    assert not small.rewritten and "fit one chunk" in small.reason

    mfusion.clear_report()
    with torch.no_grad():
        compiled = _compile(
            model, chunked_cross_entropy=True, chunked_cross_entropy_bytes=CHUNK_BYTES
        )
        torch.testing.assert_close(compiled(hidden, target), model(hidden, target))
    assert not any(d.rewritten for d in _decisions())


def test_install_sets_and_restores_the_joint_pass():
    from mfusion.joint.chunked_ce import ChunkedCrossEntropyPass

    assert inductor_config.joint_custom_pre_pass is None
    mfusion.install(backend="inductor")
    assert inductor_config.joint_custom_pre_pass is None  # off by default
    mfusion.uninstall()
    mfusion.install(backend="inductor", chunked_cross_entropy=True)
    assert isinstance(inductor_config.joint_custom_pre_pass, ChunkedCrossEntropyPass)
    mfusion.uninstall()
    assert inductor_config.joint_custom_pre_pass is None
    options = mfusion.compile_options(backend="inductor", chunked_cross_entropy=True)
    assert isinstance(options["joint_custom_pre_pass"], ChunkedCrossEntropyPass)

    class Foreign(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            pass

        def uuid(self) -> str:
            return "foreign"

    inductor_config.joint_custom_pre_pass = Foreign()
    try:
        with pytest.raises(RuntimeError, match="joint_custom_pre_pass already holds"):
            mfusion.install(chunked_cross_entropy=True)
        mfusion.install(backend="inductor")  # the post-grad passes alone leave it alone
        mfusion.uninstall()
        assert isinstance(inductor_config.joint_custom_pre_pass, Foreign)
    finally:
        inductor_config.joint_custom_pre_pass = None
