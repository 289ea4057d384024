"""Muon + AdamW hybrid: routing rules, classify override, schedulers, state dicts, empty sides."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyperparallel.optim import HybridOptimizer, Muon, get_hyper_optimizer


class ChannelNorm(nn.Module):
    """A norm with a 2-D scale, so only the class-name rule can send it to AdamW."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, tie: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 24)
        self.down = nn.Linear(24, dim, bias=False)
        self.rms = nn.RMSNorm(dim)
        self.ln = nn.LayerNorm(dim)
        self.channel = ChannelNorm(dim)
        if tie:
            self.proj = nn.Linear(dim, vocab, bias=False)
            self.proj.weight = self.wte.weight
        else:
            self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.tie = tie

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens)
        h = h + self.down(torch.relu(self.up(self.rms(h))))
        h = self.channel(self.ln(h))
        return (self.proj if self.tie else self.lm_head)(h)


def _model(tie: bool = False) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(tie=tie)


def _backward(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (2, 6), generator=gen)
    logits = model(tokens)
    nn.functional.cross_entropy(logits.reshape(-1, 32), tokens.reshape(-1)).backward()


def test_routing_sends_hidden_matrices_to_muon_and_the_rest_to_adamw():
    """Linear weights go to Muon; embedding, head, norms and biases go to AdamW."""
    opt = get_hyper_optimizer(_model())
    assert opt.routing == {
        "wte.weight": "adamw",
        "up.weight": "muon",
        "up.bias": "adamw",
        "down.weight": "muon",
        "rms.weight": "adamw",
        "ln.weight": "adamw",
        "ln.bias": "adamw",
        "channel.scale": "adamw",
        "lm_head.weight": "adamw",
    }
    assert isinstance(opt.muon, Muon) and isinstance(opt.adamw, torch.optim.AdamW)
    assert opt.muon.param_groups[0]["param_names"] == ["up.weight", "down.weight"]


def test_routing_tied_head_follows_embedding():
    """A final Linear tied to the embedding is one tensor, routed once, to AdamW."""
    model = _model(tie=True)
    opt = get_hyper_optimizer(model)
    assert opt.routing["wte.weight"] == "adamw" and "proj.weight" not in opt.routing
    _backward(model, 0)
    opt.step()


def test_classify_overrides_default_rule():
    """classify wins where it answers; None keeps the default."""
    opt = get_hyper_optimizer(
        _model(), classify=lambda name, p: "adamw" if name == "up.weight" else None
    )
    assert opt.routing["up.weight"] == "adamw" and opt.routing["down.weight"] == "muon"


def test_classify_invalid_route_names_parameter():
    """A route other than muon/adamw/None is refused with the parameter's name."""
    with pytest.raises(ValueError, match=r"'sgd' for parameter 'wte.weight'"):
        get_hyper_optimizer(_model(), classify=lambda name, p: "sgd")


def test_classify_vector_to_muon_is_refused_by_muon():
    """Forcing a bias into Muon fails at construction, naming the bias."""
    with pytest.raises(ValueError, match=r"parameter 'up.bias' .*AdamW"):
        get_hyper_optimizer(_model(), classify=lambda name, p: "muon")


def test_empty_sides_work():
    """Models with only vectors, or only matrices, get a single inner optimizer."""
    norms = nn.Sequential(nn.LayerNorm(4))
    opt = get_hyper_optimizer(norms)
    assert opt.muon is None and opt.adamw is not None
    norms(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    matrices = nn.Sequential(nn.Linear(4, 4, bias=False))
    opt = get_hyper_optimizer(matrices)
    assert opt.adamw is None and opt.muon is not None
    matrices(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert opt.state_dict()["adamw"] is None


def test_lr_scheduler_drives_both_inner_optimizers():
    """LambdaLR on the hybrid changes the inner groups' lr (they are the same dicts)."""
    model = _model()
    opt = get_hyper_optimizer(model, muon={"lr": 0.02}, adamw={"lr": 1e-3})
    assert opt.param_groups[0] is opt.muon.param_groups[0]
    assert opt.param_groups[1] is opt.adamw.param_groups[0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for step in range(2):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.25)


def test_zero_grad_clears_both_sides():
    """zero_grad(set_to_none=True) reaches every parameter."""
    model = _model()
    opt = get_hyper_optimizer(model)
    _backward(model, 0)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_round_trip_reproduces_next_step():
    """A fresh hybrid loaded from a state dict takes the same next step as the original."""
    model = _model()
    opt = get_hyper_optimizer(model, muon={"lr": 0.02}, adamw={"lr": 1e-3})
    for step in range(2):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    twin = copy.deepcopy(model)
    saved = copy.deepcopy(opt.state_dict())
    restored = get_hyper_optimizer(twin, muon={"lr": 0.5}, adamw={"lr": 0.5})
    restored.load_state_dict(saved)
    assert restored.param_groups[0] is restored.muon.param_groups[0]
    assert restored.muon.param_groups[0]["lr"] == 0.02
    for m, o in ((model, opt), (twin, restored)):
        _backward(m, 2)
        o.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_load_state_dict_rejects_mismatched_sides():
    """Loading a state dict with a missing side explains the mismatch."""
    opt = get_hyper_optimizer(_model())
    with pytest.raises(ValueError, match="has no muon state but this optimizer has a muon side"):
        opt.load_state_dict({"muon": None, "adamw": opt.adamw.state_dict()})


def test_add_param_group_after_construction_is_refused():
    """A group added to the wrapper would never be stepped, so it is refused."""
    opt = get_hyper_optimizer(_model())
    with pytest.raises(ValueError, match="not supported"):
        opt.add_param_group({"params": [torch.ones(2, 2)]})


def test_hybrid_needs_an_optimizer():
    """Two empty sides are refused."""
    with pytest.raises(ValueError, match="at least one"):
        HybridOptimizer(None, None)


@pytest.mark.parametrize(
    ("adamw", "message"),
    [
        ({"lr": float("inf")}, r"adamw: lr=inf is invalid; it must be finite"),
        ({"eps": float("nan")}, r"adamw: eps=nan is invalid; it must be finite"),
        ({"betas": (0.9, float("inf"))}, r"adamw: betas=\(0.9, inf\) is invalid"),
        ({"weight_decay": "0.1"}, r"adamw: weight_decay='0.1' is invalid; it must be a number"),
    ],
)
def test_non_finite_adamw_settings_are_refused_before_training(adamw, message):
    """torch.optim.AdamW accepts lr=inf, and the first step then makes every weight non-finite."""
    with pytest.raises(ValueError, match=message):
        get_hyper_optimizer(_model(), adamw=adamw)
