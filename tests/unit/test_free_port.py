"""The ports `pagedserve up` picks for its processes' listeners (metrics, the frontend, the gateway): free
when picked, and below the kernel's ephemeral range, whose ports any process's next outgoing connection may
take before the listener binds (a worker binds its metrics port only once its model has loaded)."""

from __future__ import annotations

import random
import socket

import pytest

from services.launcher import FIRST_PICKED_PORT, below_ephemeral_ports, free_port


def test_a_picked_port_is_free_and_below_the_ephemeral_range() -> None:
    low = below_ephemeral_ports()
    assert low > FIRST_PICKED_PORT + 500, f"this machine's ephemeral range starts at {low}"
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert FIRST_PICKED_PORT <= port < low
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))  # free: binds


def test_a_taken_port_is_not_picked() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        # A range of one taken port and 600 more: many draws, never the taken one.
        picks = {free_port("127.0.0.1", port, port + 601) for _ in range(200)}
    assert port not in picks
    assert all(port < pick < port + 601 for pick in picks)


def test_seeding_the_callers_random_does_not_make_picks_repeat() -> None:
    """Two processes of one test suite that seed `random` alike must not draw the same ports."""
    random.seed(0)
    first = [free_port("127.0.0.1") for _ in range(5)]
    random.seed(0)
    second = [free_port("127.0.0.1") for _ in range(5)]
    assert first != second


def test_a_host_that_cannot_be_bound_raises_rather_than_loops() -> None:
    with pytest.raises(OSError):
        free_port("192.0.2.1")  # TEST-NET-1: no interface of this machine holds it
