"""scripts/soak.py, briefly: two minutes of mixed traffic with a worker killed every 40 seconds.

The script starts and stops its own stack, and checks what it sees: each request's final status, the tokens
of the greedy and seeded calls a kill came during (which every moved one is) against an uninterrupted rerun,
no page left over, memory that stopped growing, a clean stop. Its summary and the stack's log tail are the
message of a failure.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from services.common.default_model import default_model_dir
from tests.procs import REPO


@pytest.fixture(scope="module", autouse=True)
def model() -> None:
    default_model_dir()


@pytest.mark.timeout(540)  # over the subprocess's own timeout
def test_two_minutes_of_mixed_traffic_and_worker_kills() -> None:
    command = [sys.executable, "scripts/soak.py", "--minutes", "2", "--kill-every", "40"]
    command += ["--concurrency", "4"]  # the tests' machines may have two cores
    done = subprocess.run(command, capture_output=True, text=True, timeout=480, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    kills = re.search(r"worker kills: (\d+)", done.stdout)
    assert kills and int(kills[1]) >= 2, done.stdout  # at 40 and 80 s, and at 120 s should it come first
    reruns = re.search(r"calls a kill came during, rerun: (\d+)", done.stdout)
    assert reruns and int(reruns[1]) >= 4 * int(kills[1]), done.stdout  # the probes at least
