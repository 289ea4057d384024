"""Argument and environment resolution, checked without starting any rank."""

from __future__ import annotations

import pytest

from mccl import config, env


def test_missing_rank_names_argument_and_variable(monkeypatch):
    """Without rank= and RANK the error says which to provide."""
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"rank was not given and RANK is not set"):
        config.resolve_request("gloo", None, None, 2, None, None)


def test_rank_out_of_range_is_refused():
    """rank must lie in [0, world_size)."""
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        config.resolve_request("gloo", None, 2, 2, None, None)


def test_defaults_come_from_torchrun_environment(monkeypatch):
    """RANK / WORLD_SIZE / MCCL_INIT_TIMEOUT fill what the call leaves out."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv(env.INIT_TIMEOUT, "12.5")
    request = config.resolve_request(None, None, None, None, 60, None)
    assert (request.rank, request.world_size, request.init_timeout_s) == (3, 8, 12.5)
    assert request.init_method == "env://" and request.timeout.total_seconds() == 60
    assert request.backend == "gloo"


@pytest.mark.parametrize("backend", ["bogus", "cpu:gloo,cuda:bogus"])
def test_unknown_backend_is_refused_at_the_call(backend):
    """A backend torch does not know is named with the allowed ones, before any thread starts."""
    with pytest.raises(
        ValueError, match=rf"backend={backend!r} is not a torch.distributed backend"
    ):
        config.resolve_request(backend, None, 0, 1, None, None)


@pytest.mark.parametrize("backend", ["gloo", "NCCL", "cpu:gloo,cuda:nccl", "hccl"])
def test_known_backends_pass_unchanged(backend):
    """Names torch knows, in any case and in the per-device form, are kept as given."""
    assert config.resolve_request(backend, None, 0, 1, None, None).backend == backend


def test_nonpositive_init_timeout_is_refused():
    """init_timeout <= 0 is an error naming the argument."""
    with pytest.raises(ValueError, match="init_timeout must be a positive, finite number"):
        config.resolve_request("gloo", None, 0, 1, None, 0)


@pytest.mark.parametrize(
    ("value", "expected"), [("0", False), ("off", False), ("1", True), ("", True)]
)
def test_async_env_switch(monkeypatch, value, expected):
    """MCCL_ASYNC_INIT=0 turns the asynchronous path off."""
    monkeypatch.setenv(env.ASYNC_INIT, value)
    assert config.async_init_enabled(True) is expected


def test_async_env_switch_rejects_garbage(monkeypatch):
    """A value that is not a boolean is refused with the variable's name."""
    monkeypatch.setenv(env.ASYNC_INIT, "maybe")
    with pytest.raises(ValueError, match="MCCL_ASYNC_INIT='maybe'"):
        config.async_init_enabled(True)
