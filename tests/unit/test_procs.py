"""tests/procs.py: a test's process that hangs stopping is killed, and the test fails; a free port is one no
bind to port 0 can be handed. tests/cores.py: how pytest-xdist's workers share the cores."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from services.launcher import FIRST_PICKED_PORT, below_ephemeral_ports
from tests.cores import share
from tests.procs import free_port, terminate

DEAF = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('deaf', flush=True); "
    "time.sleep(9)"
)


def test_a_process_deaf_to_sigterm_is_killed_and_the_test_fails() -> None:
    proc = subprocess.Popen([sys.executable, "-c", DEAF], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"deaf\n"  # it ignores SIGTERM from here on
    with pytest.raises(AssertionError, match=r"did not stop within 0.5 s of SIGTERM(.|\n)*its last words"):
        terminate(proc, 0.5, lambda: "its last words")
    assert proc.returncode == -signal.SIGKILL


def test_a_process_that_stops_gives_its_exit_status() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert terminate(proc, 10) == -signal.SIGTERM


def test_a_free_port_is_below_the_ephemeral_range_and_free() -> None:
    low = below_ephemeral_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # as a worker's metrics port is bound: the kernel picks
        kernels = taken.getsockname()[1]
        ports = {free_port() for _ in range(200)}
    assert kernels >= low and all(port < low for port in ports), (low, kernels, sorted(ports)[-3:])
    for port in ports:
        with socket.socket() as mine:
            mine.bind(("127.0.0.1", port))


def test_two_xdist_workers_draw_free_ports_from_disjoint_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    drawn = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        drawn.append({free_port() for _ in range(100)})
    low = below_ephemeral_ports()
    assert min(drawn[0]) >= FIRST_PICKED_PORT and max(drawn[0]) < min(drawn[1]) and max(drawn[1]) < low


@pytest.mark.parametrize(
    ("cores", "workers", "shares"),
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3, 4], 2, [[0, 2, 4], [1, 3]]),
        ([4, 7], 3, [[4], [7], [4]]),  # more workers than cores: one core each, shared
    ],
)
def test_xdist_workers_get_disjoint_shares_of_the_cores(
    cores: list[int], workers: int, shares: list[list[int]]
) -> None:
    assert [share(cores, index, workers) for index in range(workers)] == shares
