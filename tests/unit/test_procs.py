"""tests/procs.py: a test's process that hangs stopping is killed, and the test fails."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.procs import terminate

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
