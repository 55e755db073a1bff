"""The ports the harness hands out (metrics ports of test and demo workers): below the
kernel's ephemeral range, in a block of each pytest-xdist worker, so that another
process's ``bind(("127.0.0.1", 0))`` (another test's proxy, started in the moment
between the port being found free and the worker binding it) is never given it: a
health probe then asked the other test's proxy and read ``AMQP`` for an HTTP status
line."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from workers.harness import fleet


def _ephemeral() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


@pytest.mark.parametrize(("worker", "block"), [("gw0", 24000), ("gw1", 25000), ("", 31000)])
def test_a_free_port_is_in_this_workers_block_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch, worker: str, block: int
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    ports = [fleet.free_port() for _ in range(5)]
    assert all(block <= p < block + fleet.PORT_BLOCK for p in ports), ports
    assert len(set(ports)) == 5, "each call a port of its own"
    assert max(ports) < _ephemeral()[0], "never one that another process's bind(0) is given"


def test_a_port_someone_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk tries the next port of its block first: held by a listener, it is
    passed over."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    nxt = fleet.free_port() + 1
    if nxt == 26000 + fleet.PORT_BLOCK:
        nxt = 26000  # the walk wraps round its block
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", nxt))
        held.listen()
        found = fleet.free_port()
    assert found != nxt and 26000 <= found < 26000 + fleet.PORT_BLOCK
