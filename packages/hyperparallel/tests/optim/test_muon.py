"""Muon: parity with torch.optim.Muon, experts and conv weights, validation, NaN skipping, state."""

from __future__ import annotations

import copy

import pytest
import torch

from hyperparallel.optim import Muon
from hyperparallel.optim import muon as muon_module

SHAPES = [(8, 8), (12, 5), (5, 12), (16, 24)]


def _params(shapes, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def _set_grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_muon(adjust_lr, nesterov):
    """Several steps on square, tall and wide matrices equal torch.optim.Muon within 1e-6."""
    ours, ref = _params(SHAPES), _params(SHAPES)
    hyper = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": nesterov}
    opt = Muon(
        ours, adjust_lr=adjust_lr, ns_coefficients="keller", ns_steps=5, ns_dtype="bf16", **hyper
    )
    ref_opt = torch.optim.Muon(ref, adjust_lr_fn=adjust_lr, **hyper)
    for step in range(4):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
    for p, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], ref_opt.state[r]["momentum_buffer"], rtol=0, atol=0
        )


def test_muon_auto_dtype_is_fp32_where_bf16_gemms_are_slow(monkeypatch):
    """On a device whose bf16 GEMMs are emulated, the default Muon steps in fp32: its update
    equals an fp32 Newton-Schulz run, not the bf16 one torch.optim.Muon would take."""
    from npu_core import capability

    monkeypatch.setattr(capability, "fast_matmul", lambda device, dtype: False)
    ours, fp32, bf16 = _params([(12, 20)]), _params([(12, 20)]), _params([(12, 20)])
    optimizers = [Muon(ours), Muon(fp32, ns_dtype="fp32"), Muon(bf16, ns_dtype="bf16")]
    for params, opt in zip((ours, fp32, bf16), optimizers, strict=True):
        _set_grads(params, 0)
        opt.step()
    assert torch.equal(ours[0], fp32[0])
    assert not torch.equal(ours[0], bf16[0])
    monkeypatch.setattr(capability, "fast_matmul", lambda device, dtype: True)
    fast = _params([(12, 20)])
    _set_grads(fast, 0)
    Muon(fast).step()
    assert torch.equal(fast[0], bf16[0])


def test_muon_experts_are_independent_matrices():
    """A [3, 6, 10] expert weight steps like three separate [6, 10] weights."""
    (experts,) = _params([(3, 6, 10)])
    singles = [experts[e].detach().clone().requires_grad_() for e in range(3)]
    opt_experts, opt_singles = Muon([experts], lr=0.05), Muon(singles, lr=0.05)
    for step in range(2):
        _set_grads([experts], step)
        for e, p in enumerate(singles):
            p.grad = experts.grad[e].clone()
        opt_experts.step()
        opt_singles.step()
    torch.testing.assert_close(experts.detach(), torch.stack(singles).detach(), rtol=0, atol=1e-6)


def test_muon_conv_weight_is_flattened():
    """A conv weight [4, 3, 2, 2] steps like its [4, 12] flattening, and keeps its shape."""
    (conv,) = _params([(4, 3, 2, 2)])
    flat = conv.detach().reshape(4, 12).clone().requires_grad_()
    opt_conv, opt_flat = Muon([conv]), Muon([flat])
    _set_grads([conv], 0)
    flat.grad = conv.grad.reshape(4, 12).clone()
    opt_conv.step()
    opt_flat.step()
    assert conv.shape == (4, 3, 2, 2)
    torch.testing.assert_close(conv.detach().reshape(4, 12), flat.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("params", "kwargs", "match"),
    [
        ([torch.ones(3, 3), torch.ones(4)], {}, r"parameter 1 of param group 0 .*AdamW"),
        ([("w", torch.ones(3, 3)), ("bias", torch.ones(4))], {}, r"parameter 'bias' .*AdamW"),
        ([torch.ones(3, 3, dtype=torch.int64)], {}, r"dtype torch.int64"),
        ([torch.ones(3, 3)], {"lr": -0.1}, r"lr=-0.1 is invalid"),
        ([torch.ones(3, 3)], {"lr": float("inf")}, r"lr=inf is invalid; it must be a finite"),
        ([torch.ones(3, 3)], {"weight_decay": float("nan")}, r"weight_decay=nan is invalid"),
        ([torch.ones(3, 3)], {"momentum": 1.0}, r"momentum=1.0 is invalid.*\[0, 1\)"),
        ([torch.ones(3, 3)], {"weight_decay": -1.0}, r"weight_decay=-1.0 is invalid"),
        ([torch.ones(3, 3)], {"ns_steps": 0}, r"ns_steps=0 is invalid"),
        ([torch.ones(3, 3)], {"ns_coefficients": "fast"}, r"ns_coefficients='fast'"),
        ([torch.ones(3, 3)], {"adjust_lr": "none"}, r"adjust_lr='none' is invalid"),
        ([torch.ones(3, 3)], {"ns_dtype": "fp8"}, r"ns_dtype='fp8' is invalid; use one of"),
        ([{"params": [torch.ones(3, 3)], "ns_dtype": "fp32"}], {}, r"sets \['ns_dtype'\]"),
        ([{"params": [torch.ones(3, 3)], "ns_steps": 3}], {}, r"group 0 sets \['ns_steps'\]"),
        ([{"params": [torch.ones(3, 3)], "lr": -1.0}], {}, r"param group 0: lr=-1.0"),
    ],
)
def test_muon_rejects_invalid_arguments(params, kwargs, match):
    """Each bad parameter or hyperparameter is named with its value and what is allowed."""
    with pytest.raises(ValueError, match=match):
        Muon(params, **kwargs)


def test_muon_skips_parameter_with_nan_gradient():
    """A NaN gradient leaves that weight and its momentum untouched; others still step."""
    bad, good = _params([(6, 4), (6, 4)])
    opt = Muon([("bad", bad), ("good", good)])
    bad_before, good_before = bad.detach().clone(), good.detach().clone()
    _set_grads([bad, good], 0)
    bad.grad[2, 1] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped parameter 'bad'"):
        opt.step()
    assert torch.equal(bad.detach(), bad_before)
    assert "momentum_buffer" not in opt.state[bad]
    assert not torch.equal(good.detach(), good_before)
    assert opt.skipped_steps == {"bad": 1}
    _set_grads([bad, good], 1)
    bad.grad[0, 0] = float("inf")
    with pytest.warns(RuntimeWarning):
        opt.step()
    assert opt.skipped_steps == {"bad": 2}
    assert torch.isfinite(bad).all() and torch.isfinite(good).all()


def test_muon_skip_counter_uses_flat_index_for_unnamed_params():
    """Unnamed parameters are counted by their position over all groups."""
    a, b = _params([(4, 4), (4, 4)])
    opt = Muon([{"params": [a]}, {"params": [b]}])
    _set_grads([a, b], 0)
    b.grad.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped parameter 1"):
        opt.step()
    assert opt.skipped_steps == {1: 1}


def test_muon_refuses_mixed_dtensor_and_plain_at_construction(monkeypatch):
    """Sharded and plain parameters in one Muon are refused when it is built, as its docstring
    promises, in one group or across groups added later (the group is not kept)."""
    sharded, plain = _params([(4, 4), (3, 5)])
    monkeypatch.setattr(muon_module, "_is_dtensor", lambda t: t is sharded)
    with pytest.raises(ValueError, match="both DTensor and plain tensor parameters"):
        Muon([sharded, plain])
    opt = Muon([sharded])
    with pytest.raises(ValueError, match="both DTensor and plain tensor parameters"):
        opt.add_param_group({"params": [plain]})
    assert [g["params"] for g in opt.param_groups] == [[sharded]]


def test_muon_engine_receives_all_updates(monkeypatch):
    """An attached engine gets every update in one call and its result is applied."""
    monkeypatch.setattr(muon_module, "_is_dtensor", lambda t: True)
    params = _params([(4, 4), (3, 5)])
    seen = []

    def engine(updates, ps):
        seen.append([tuple(u.shape) for u in updates])
        return [torch.zeros_like(u) for u in updates]

    opt = Muon(params, weight_decay=0.0)
    opt._engine = engine
    before = [p.detach().clone() for p in params]
    _set_grads(params, 0)
    opt.step()
    assert seen == [[(4, 4), (3, 5)]]
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)


def test_muon_state_dict_round_trip():
    """A loaded state dict reproduces the next step exactly."""
    params = _params(SHAPES)
    opt = Muon(params, lr=0.03)
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    clones = [p.detach().clone().requires_grad_() for p in params]
    restored = Muon(clones, lr=0.5)
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))  # no shared buffers
    assert restored.param_groups[0]["lr"] == 0.03
    _set_grads(params, 2)
    _set_grads(clones, 2)
    opt.step()
    restored.step()
    for p, c in zip(params, clones, strict=True):
        assert torch.equal(p, c)


def test_sharded_engine_refuses_plain_tensor_updates():
    """The distributed engine names the first update that is not a DTensor, before any
    collective (Muon only hands it DTensors; a direct caller gets a clear error)."""
    from hyperparallel.optim.distributed import ShardedNewtonSchulz

    engine = ShardedNewtonSchulz(lambda matrices: matrices)
    updates = [torch.zeros(4, 4), torch.zeros(2, 3)]
    with pytest.raises(TypeError, match=r"update #0 is a Tensor"):
        engine(updates, updates)
