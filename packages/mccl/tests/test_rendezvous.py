"""Waiting for the ranks to arrive, on a real TCPStore in this process (no process group)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from mccl._rendezvous import announce, await_arrivals, connect_store
from mccl.config import InitRequest
from mccl.errors import InitTimeoutError, MCCLError
from npu_core.dist import LOOPBACK, find_free_port


def _request(rank: int, world_size: int, port: int, init_timeout: float = 30.0) -> InitRequest:
    return InitRequest(
        backend="gloo",
        init_method=f"tcp://{LOOPBACK}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=30),
        init_timeout_s=init_timeout,
    )


@pytest.fixture
def port() -> int:
    return find_free_port()


def _host(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, world_size, is_master=True, wait_for_workers=False)


def test_returns_when_the_last_rank_arrives(port):
    """A rank arriving 0.3 s late releases the waiter shortly after, not at the deadline."""
    host = _host(port, 2)
    first, late = _request(0, 2, port), _request(1, 2, port)
    announce(host, first)
    threading.Timer(0.3, announce, (host, late)).start()
    start = time.monotonic()
    await_arrivals(host, first, time.monotonic() + 30.0, threading.Event())
    assert 0.25 <= time.monotonic() - start < 2.0


def test_deadline_names_the_ranks_that_never_arrived(port):
    """At the deadline, InitTimeoutError lists exactly the absent ranks and the address."""
    host = _host(port, 4)
    for rank in (0, 2):
        announce(host, _request(rank, 4, port))
    start = time.monotonic()
    with pytest.raises(InitTimeoutError) as info:
        await_arrivals(host, _request(0, 4, port, 1.0), time.monotonic() + 1.0, threading.Event())
    assert 1.0 <= time.monotonic() - start < 2.5
    assert info.value.missing_ranks == [1, 3]
    assert info.value.address == f"{LOOPBACK}:{port}"


def test_stop_ends_the_wait_at_once(port):
    """Setting the stop event (interpreter exit) ends a wait long before its deadline."""
    host = _host(port, 2)
    announce(host, _request(0, 2, port))
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    with pytest.raises(MCCLError, match="abandoned"):
        await_arrivals(host, _request(0, 2, port), time.monotonic() + 60.0, stop)
    assert time.monotonic() - start < 2.0


def test_store_closing_names_the_ranks_still_missing(port):
    """When the store's host goes away, a waiting client names the ranks it still missed."""
    hosts = [_host(port, 3)]  # the only reference: clearing the list shuts the server down
    request = _request(1, 3, port)
    client = connect_store(request, time.monotonic() + 10.0, threading.Event())
    announce(hosts[0], _request(0, 3, port))
    announce(client, request)
    threading.Timer(0.8, hosts.clear).start()
    with pytest.raises(InitTimeoutError, match="when it closed") as info:
        await_arrivals(client, request, time.monotonic() + 30.0, threading.Event())
    assert info.value.missing_ranks == [2]


def test_unreachable_store_names_rank_0_at_the_deadline(port):
    """A joining rank whose store never comes up gets rank 0 named, at init_timeout."""
    start = time.monotonic()
    with pytest.raises(InitTimeoutError) as info:
        connect_store(_request(1, 2, port, 1.0), time.monotonic() + 1.0, threading.Event())
    assert 1.0 <= time.monotonic() - start < 2.5
    assert info.value.missing_ranks == [0]


def test_joins_a_store_that_comes_up_late(port):
    """A joining rank started 2.5 s before its store host still connects, well before the limit."""
    hosts: list[dist.TCPStore] = []
    threading.Timer(2.5, lambda: hosts.append(_host(port, 2))).start()
    start = time.monotonic()
    client = connect_store(_request(1, 2, port, 30.0), time.monotonic() + 30.0, threading.Event())
    assert 2.4 <= time.monotonic() - start < 8.0
    client.set("k", "v")
    assert hosts[0].get("k") == b"v"
