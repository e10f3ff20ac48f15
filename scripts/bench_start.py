"""How long `pagedserve up` takes to come up: from its start to each child's first line saying it serves, and
to the launcher's "pagedserve is up", over a few starts on the default model (the model converted and the
C++ CPU kernels built beforehand: the first start of a machine pays those once). Every test that starts a
stack waits this long.

    python scripts/bench_start.py [--repeats 3] [--cores 0] [UP FLAGS...]

--cores pins the stack to those cores (taskset's list), as a test process under `pytest -n 2` is pinned to
one. Prints each start's times in seconds and their medians.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

MARKS = {  # a line's text: the event it marks
    "memory daemon serving on": "daemon",
    "worker 'worker-0' serving on": "worker-0",
    "worker 'worker-1' serving on": "worker-1",
    "frontend serving": "frontend",
    "pagedserve is up on": "up",
}


def one_start(up_flags: list[str], cores: str) -> dict[str, float]:
    """Seconds from the launch to each mark, for one start; the stack is stopped once it is up."""
    with tempfile.TemporaryDirectory(prefix="ps-") as run_dir:
        command = [sys.executable, "-m", "services.cli", "up", "--run-dir", run_dir, "--port", "0", *up_flags]
        if cores:
            command = ["taskset", "-c", cores, *command]
        started = time.monotonic()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: dict[str, float] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            for text, mark in MARKS.items():
                if text in line and mark not in seen:
                    seen[mark] = time.monotonic() - started
            if "up" in seen:
                proc.send_signal(signal.SIGTERM)
                break
        proc.communicate(timeout=60)
        if "up" not in seen:
            raise SystemExit(f"pagedserve up did not come up (exit {proc.returncode})")
        return seen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", default="0", help="taskset's core list; empty: every core")
    args, up_flags = parser.parse_known_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    runs = [one_start(up_flags, args.cores) for _ in range(args.repeats)]
    marks = [mark for mark in MARKS.values() if all(mark in run for run in runs)]
    print("start  " + "  ".join(f"{mark:>9}" for mark in marks))
    for i, run in enumerate(runs, start=1):
        print(f"{i:>5}  " + "  ".join(f"{run[mark]:9.2f}" for mark in marks))
    print("median " + "  ".join(f"{statistics.median(run[mark] for run in runs):9.2f}" for mark in marks))


if __name__ == "__main__":
    main()
