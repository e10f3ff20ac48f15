"""The child processes of `pagedserve up`: started in order, each once healthy, restarted when they die.

Each child starts only after the one it needs reports SERVING through grpc.health.v1, except one that
says when it has reached what it needs (the frontend, which reaches its workers as they come up: it starts
beside them), and every line a child prints comes out prefixed with its name.
Children get SIGTERM if this process dies (PR_SET_PDEATHSIG, which each asks for as it starts: spawn), so
none is orphaned, and run in sessions of their own, so that a terminal's Ctrl-C reaches only the launcher,
which stops them in order: the frontend drains first, the daemon goes last. A child that dies is started
again, unless it died more than RESTART_LIMIT times within a minute.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.plumbing.rpc import wait_for_health

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
PARENT_ENV = "PAGEDSERVE_PARENT_PID"  # set by spawn: the process a child must not outlive


def die_with_parent() -> None:
    """SIGTERM to this process when its parent exits (PR_SET_PDEATHSIG)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(command: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start a pagedserve process (`python -m services.cli ...`) in a session of its own; it dies with this
    one, which it asks the kernel for as it starts (die_with_spawner).

    Not a preexec_fn: that makes subprocess fork() rather than vfork(), and a fork runs gRPC's fork handlers,
    which can deadlock with gRPC's own grpc_shutdown thread once a process's channels have closed
    (grpc/grpc#31885): `up` hung so, starting its frontend after its health checks of the daemon and
    worker."""
    env = {**env, PARENT_ENV: str(os.getpid())}
    return subprocess.Popen(command, env=env, start_new_session=True, **popen)


def die_with_spawner() -> None:
    """In a process that spawn started: die with the process that started it, at once if that is gone."""
    spawner = os.environ.pop(PARENT_ENV, None)
    if spawner is None:
        return
    die_with_parent()
    if os.getppid() != int(spawner):  # it exited before the request above: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def http_ready(url: str) -> bool:
    """Whether an HTTP server (SMG's gateway) answers url/readiness with 200: it is up and can route."""
    try:
        with urllib.request.urlopen(f"{url}/readiness", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_PICKED_PORT = 10000
_ports = random.Random()  # its own: a caller's random.seed() must not make two processes pick alike


def below_ephemeral_ports() -> int:
    """The first port of the kernel's ephemeral range (0 where it does not say)."""
    return int(EPHEMERAL_PORTS.read_text().split()[0]) if EPHEMERAL_PORTS.exists() else 0


def free_port(host: str, first: int = FIRST_PICKED_PORT, end: int | None = None) -> int:
    """A port free now on host, drawn from [first, end), below the kernel's ephemeral range by default. A port
    a bind to 0 hands out is one the kernel may give the next outgoing connection of any process, and a
    worker binds its metrics port only once its model has loaded: CI saw one refused so (EADDRINUSE). Pick
    it just before use all the same, as it may not stay free."""
    end = below_ephemeral_ports() if end is None else end
    while True:
        port = _ports.randrange(first, end) if end > first + 500 else 0
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    continue  # taken
                raise  # a host this socket cannot bind (the caller's to report), not a port to skip
            return int(probe.getsockname()[1])


RESTART_LIMIT = 5  # restarts of one child within a minute
START_TIMEOUT_S = 600.0  # for a child to report SERVING once started


@dataclass
class Child:
    name: str
    args: list[str]
    address: str  # where its health is checked
    health_service: str = ""  # the grpc.health.v1 service checked ("": the server as a whole)
    # Checked instead at the stack's start, when the child may start before what it needs is up: it says the
    # child has reached all of it. A restart checks health_service, since what it needs may be down too.
    start_health_service: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    deaths: list[float] = field(default_factory=list)  # when it died, for the restart limit

    def exit_reason(self) -> str:
        assert self.proc is not None
        code = self.proc.returncode
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"

    def dead(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


class Launcher:
    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.env = env
        self.children: list[Child] = []
        self.stopping = threading.Event()  # set by Ctrl-C or SIGTERM
        self._print_lock = threading.Lock()

    def start(self, *children: Child) -> None:
        """Start children together, and wait in their order until each reports SERVING (one worker after
        another took their start times added up); one that needs another given here says, through its
        start_health_service, when it has reached it. A child started before them, or one of them, that
        dies stops the start."""
        self.children.extend(children)
        for child in children:
            self._spawn(child)
        deadline = time.monotonic() + START_TIMEOUT_S
        for child in children:
            self._wait_serving(child, deadline, restarting=False)

    def _spawn(self, child: Child) -> None:
        command = [sys.executable, "-m", "services.cli", *child.args]
        # A session of its own: a terminal's Ctrl-C reaches only this launcher, which stops children in order.
        child.proc = spawn(command, self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(
            target=self._relay, args=(child, child.proc), name=f"log-{child.name}", daemon=True
        ).start()

    def _wait_serving(self, child: Child, deadline: float, restarting: bool) -> None:
        """Wait until child reports SERVING. While restarting, another child that dies (a sibling worker)
        waits its turn, to be restarted next."""
        while True:
            dead = child if child.dead() else None
            if dead is None and not restarting:
                dead = self.first_dead()  # one started before it
            if dead is not None:
                raise ChildDied(dead)
            if self.stopping.is_set():
                raise Interrupted(f"stopped while {child.name} was starting")
            service = child.health_service
            if not restarting and child.start_health_service is not None:
                service = child.start_health_service
            try:
                if not child.address.startswith("http://"):
                    wait_for_health(child.address, 1.0, service)
                elif not http_ready(child.address):
                    raise TimeoutError
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{child.name} did not report SERVING within {START_TIMEOUT_S:.0f}s"
                    ) from None

    def restart(self, child: Child) -> None:
        """Start a dead child again, unless it was restarted RESTART_LIMIT times within the last minute."""
        now = time.monotonic()
        child.deaths = [t for t in child.deaths if now - t < 60.0] + [now]
        if len(child.deaths) > RESTART_LIMIT:
            raise ChildDied(child, f"; it died {len(child.deaths)} times within a minute")
        self.say(f"{child.name} {child.exit_reason()}; starting it again")
        self._spawn(child)
        self._wait_serving(child, time.monotonic() + START_TIMEOUT_S, restarting=True)
        self.say(f"{child.name} is back")

    def say(self, message: str) -> None:
        with self._print_lock:
            print(f"{'up':>9} | {message}", flush=True)

    def first_dead(self) -> Child | None:
        return next((child for child in self.children if child.dead()), None)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        """Stop in reverse order of start: the frontend drains first, the daemon goes last."""
        for child in reversed(self.children):
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.say(f"{child.name} did not stop within {timeout_s:.0f}s; killing it")
                    child.proc.kill()
                    child.proc.wait()

    def _relay(self, child: Child, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            with self._print_lock:
                print(f"{child.name:>9} | {line}", flush=True)


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM came before the stack was up."""


class ChildDied(RuntimeError):
    def __init__(self, child: Child, why: str = "") -> None:
        self.child = child
        super().__init__(f"{child.name} {child.exit_reason()}{why}")
