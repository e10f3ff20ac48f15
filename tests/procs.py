"""Real processes for tests: a memory daemon on a unix socket, with its pools in a private /dev/shm folder."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.common.rpc import wait_for_health

REPO = Path(__file__).resolve().parents[1]


@dataclass
class DaemonProcess:
    proc: subprocess.Popen[bytes]
    address: str
    shm_dir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)


def start_daemon(
    run_dir: Path,
    *extra: str,
    address: str | None = None,
    shm_dir: Path | None = None,
    entry: tuple[str, ...] = (sys.executable, "-m", "memory_daemon"),
) -> DaemonProcess:
    """Start a daemon (by default on a unix socket in run_dir) and wait until it reports SERVING."""
    shm_dir = shm_dir or Path(tempfile.mkdtemp(prefix="pagedserve-test-", dir="/dev/shm"))
    address = address or f"unix:{run_dir}/daemon.sock"
    log_path = run_dir / "daemon.log"
    command = [*entry, "--address", address, "--shm-dir", str(shm_dir), *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    daemon = DaemonProcess(proc, address, shm_dir, log_path)
    try:
        wait_for_health(address, timeout_s=30)
    except TimeoutError:
        daemon.stop()
        raise AssertionError(f"the daemon did not come up:\n{daemon.log()}") from None
    return daemon


class KVAgent:
    """A DaemonKVCache in a process of its own (tests/integration/kv_agent.py), driven over stdin/stdout."""

    def __init__(
        self,
        address: str,
        name: str,
        model_id: str = "test-model",
        num_pages: int = 64,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        args = [address, name, model_id, str(num_pages), device, dtype]
        command = [sys.executable, "-m", "tests.integration.kv_agent", *args]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True, bufsize=1
        )
        self.name = name
        self._expect_ok(self._reply())

    def __call__(self, op: str, **args: object) -> object:
        """Run one command in the agent; returns its result, raises AssertionError on its error."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        return self._expect_ok(self._reply())

    def try_call(self, op: str, **args: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        return self._reply()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> int:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        return self.proc.wait(timeout=20)

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"agent {self.name} exited with {self.proc.wait(timeout=10)}")
        return json.loads(line)

    def _expect_ok(self, reply: dict) -> object:
        if "error" in reply:
            raise AssertionError(f"agent {self.name}: {reply['error']}")
        return reply["ok"]
