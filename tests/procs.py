"""Real processes for tests: daemons, workers and whole stacks, on unix sockets and free ports.

tests/clients.py has the clients that talk to them.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.plumbing.auth import SECRET_ENV
from pagedserve.plumbing.rpc import wait_for_health
from services.client import tls_credentials
from services.common.default_model import default_model_dir
from services.launcher import FIRST_PICKED_PORT, below_ephemeral_ports
from services.launcher import free_port as launcher_free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
# Every process the tests start inherits this secret, as `pagedserve up` hands its children one.
SECRET = os.environ.setdefault(SECRET_ENV, secrets.token_urlsafe(16))


def terminate(proc: subprocess.Popen[bytes], timeout_s: float, log: Callable[[], str] = str) -> int:
    """SIGTERM proc and return its exit status; one still running after timeout_s is SIGKILLed and the test
    fails, so that a process that hangs stopping never runs on into the next tests."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"{proc.args} did not stop within {timeout_s} s of SIGTERM, so it was killed:\n"
                             f"{log()[-4000:]}") from None  # fmt: skip


@dataclass
class ServiceProcess:
    """A pagedserve process serving gRPC at address, its output in log_path."""

    proc: subprocess.Popen[bytes]
    address: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM and wait; returns the exit status (see terminate)."""
        return terminate(self.proc, timeout_s, self.log)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


# The /dev/shm folders start_daemon made, removed at the end of the session (tests/conftest.py); a test that
# looks for pool files left behind looks first (the `daemon` fixture).
SHM_DIRS: list[Path] = []


@dataclass
class DaemonProcess(ServiceProcess):
    shm_dir: Path


def start_service(command: list[str], address: str, log_path: Path, timeout_s: float = 120) -> ServiceProcess:
    """Start a process and wait until it reports SERVING at address."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    service = ServiceProcess(proc, address, log_path)
    try:
        wait_for_health(address, timeout_s=timeout_s)
    except TimeoutError:
        service.stop()
        raise AssertionError(f"{command[:4]} did not come up:\n{service.log()}") from None
    return service


def start_daemon(
    run_dir: Path,
    *extra: str,
    address: str | None = None,
    shm_dir: Path | None = None,
    entry: tuple[str, ...] = (sys.executable, "-m", "memory_daemon"),
) -> DaemonProcess:
    """Start a daemon (by default on a unix socket in run_dir) and wait until it reports SERVING."""
    if shm_dir is None:
        shm_dir = Path(tempfile.mkdtemp(prefix="pagedserve-test-", dir="/dev/shm"))
        SHM_DIRS.append(shm_dir)
    address = address or f"unix:{run_dir}/daemon.sock"
    command = [*entry, "--address", address, "--shm-dir", str(shm_dir), *extra]
    service = start_service(command, address, run_dir / "daemon.log", timeout_s=30)
    return DaemonProcess(service.proc, address, service.log_path, shm_dir)


def float32_unless_told(extra: tuple[str, ...]) -> tuple[str, ...]:
    """The tests compare tokens with transformers in float32, and `--dtype auto` picks bfloat16 on a CPU that
    runs it in hardware: a worker's dtype is float32 unless a test asks for another."""
    return extra if "--dtype" in extra else (*extra, "--dtype", "float32")


def run_local_worker(*flags: str) -> subprocess.CompletedProcess[str]:
    """A worker on an in-process pool (--kv local), run to its end: for what stops one at start."""
    command = [sys.executable, "-m", "services.cli", "worker", "--kv", "local", *flags]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)


def start_worker(run_dir: Path, daemon_address: str, *extra: str, name: str = "worker") -> ServiceProcess:
    """Start `pagedserve worker` against a daemon, on a unix socket in run_dir."""
    address = f"unix:{run_dir}/{name}.sock"
    command = [sys.executable, "-m", "services.cli", "worker", "--name", name, "--address", address]
    command += ["--daemon", daemon_address, *float32_unless_told(extra)]
    return start_service(command, address, run_dir / f"{name}.log")


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


@dataclass
class Stack:
    """`pagedserve up` as a real process tree: its frontend address and the run folder of its sockets."""

    proc: subprocess.Popen[bytes]
    address: str
    run_dir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_address(self, index: int = 0) -> str:
        return f"unix:{self.run_dir}/worker-{index}.sock"

    @property
    def daemon_address(self) -> str:
        return f"unix:{self.run_dir}/daemon.sock"

    def endpoints(self) -> dict[str, Any]:
        """endpoints.json: the addresses and metrics URLs `up` wrote of its processes."""
        return dict(json.loads((self.run_dir / "endpoints.json").read_text()))

    def metrics_url(self, role: str, index: int = 0) -> str:
        """The /metrics URL of the stack's frontend, daemon, or worker `index`."""
        endpoints = self.endpoints()
        return str((endpoints["workers"][index] if role == "worker" else endpoints[role])["metrics"])

    @property
    def gateway_address(self) -> str:
        """The frontend's gateway listener (--gateway-address), as endpoints.json names it."""
        address = self.endpoints()["frontend"]["gateway_address"]
        assert address, "this stack's frontend has no --gateway-address"
        return str(address)

    def survivors(self) -> list[str]:
        """Processes still running whose command line names this stack's run folder."""
        found = subprocess.run(["pgrep", "-af", str(self.run_dir)], capture_output=True, text=True)
        return [line for line in found.stdout.splitlines() if "pgrep" not in line]

    def pid(self, role: str) -> int:
        """The process id of the stack's one `role` process: daemon, worker or frontend."""
        (pid,) = [int(line.split()[0]) for line in self.survivors() if f"services.cli {role} " in line]
        return pid

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM and wait; returns the exit status (see terminate: its children die with it)."""
        return terminate(self.proc, timeout_s, self.log)


STACKS: list[Stack] = []  # every stack the tests started, so that a failed test cannot leak one


def free_port() -> int:
    """A port nothing listens on, from below the kernel's ephemeral range (services.launcher.free_port says
    why; CI once saw a frontend refused its port so). Under pytest-xdist each test process draws from its own
    slice of that range: two drawing from all of it could both probe the same port free before either stack
    bound it."""
    first, end = FIRST_PICKED_PORT, below_ephemeral_ports()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count:
        width = (end - FIRST_PICKED_PORT) // int(count)
        first += int(worker.removeprefix("gw")) * width
        end = first + width
    return launcher_free_port("127.0.0.1", first, end)


def launch_stack(run_dir: Path, *extra: str, host: str = "127.0.0.1") -> Stack:
    """Start `pagedserve up` on a free port, bound to host, and return at once; clients use loopback."""
    port = str(free_port())
    command = [sys.executable, "-m", "services.cli", "up", "--host", host, "--port", port]
    command += ["--run-dir", str(run_dir / "run"), *float32_unless_told(extra)]
    log_path = run_dir / "up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    stack = Stack(proc, f"127.0.0.1:{port}", run_dir / "run", log_path)
    STACKS.append(stack)
    return stack


def start_stack(
    run_dir: Path, *extra: str, timeout_s: float = 300, tls_ca: Path | None = None, host: str = "127.0.0.1"
) -> Stack:
    """Start `pagedserve up` on a free port and wait until its frontend has a worker up.

    tls_ca: the frontend serves TLS with a certificate this CA file vouches for.
    """
    stack = launch_stack(run_dir, *extra, host=host)
    proc, address = stack.proc, stack.address

    def came_up_or_exited() -> str | None:
        if "pagedserve is up on" in stack.log():
            return "up"
        return "exited" if proc.poll() is not None else None

    try:
        state = wait_until(came_up_or_exited, timeout_s, "pagedserve up to come up", interval_s=0.1)
    except AssertionError:
        state = "timed out"
    if state != "up":
        stack.stop()
        raise AssertionError(f"pagedserve up did not come up ({state}):\n{stack.log()}")
    credentials = tls_credentials(str(tls_ca)) if tls_ca else None
    wait_for_health(address, timeout_s=10, service="pagedserve.v1.Generation", credentials=credentials)
    return stack


@contextlib.contextmanager
def module_stack(*extra: str) -> Iterator[Stack]:
    """`pagedserve up` on the default model in a folder of its own, for a test module's fixture; it must stop
    cleanly and leave no process behind."""
    default_model_dir()  # convert once before the processes race for it
    run_dir = Path(tempfile.mkdtemp(prefix="ps-"))
    running = start_stack(run_dir, *extra)
    yield running
    assert running.stop() == 0, running.log()
    assert not running.survivors(), "pagedserve up left processes behind"
    shutil.rmtree(run_dir, ignore_errors=True)
