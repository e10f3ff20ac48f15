"""`pagedserve up`: the daemon, the workers and the frontend as separate OS processes on this machine.

Internal services talk over unix sockets in a private run folder; only the frontend listens on TCP, with
TLS and a bearer token if asked. The internal calls carry a shared secret made fresh for each run and handed
to the children in their environment. Each child starts only after the one it needs reports SERVING through
grpc.health.v1, and every line a child prints comes out prefixed with its name. Ctrl-C or SIGTERM drains
the frontend, then stops the workers and the daemon; children also get SIGTERM if this process dies
(PR_SET_PDEATHSIG), so none is orphaned. If a child dies, the launcher says which one and why, and starts
it again: a worker re-attaches to the daemon's pool, whose cached prefixes outlive it, and after a daemon
restart the workers attach to the new one. A child that keeps dying (more than RESTART_LIMIT restarts in a
minute), or any death under --no-restart, stops the whole stack. Ctrl-C while the stack is still starting
stops it too, within a second.

The launcher checks the frontend's health on a unix socket of its own (--local-address), so that a TLS
certificate issued for another name, or a wildcard --host, does not stand in the way.

Each child also serves Prometheus metrics on a free loopback port (unless --no-metrics). Once all are up,
`{run_dir}/endpoints.json` names every process's address and metrics URL, for tools such as the bench:
{"frontend": {"address", "metrics"}, "daemon": {"address", "metrics"}, "workers": [{"name", "address",
"metrics"}]}, with null metrics when they are off.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.auth import SECRET_ENV
from services.common.metrics import METRICS_HOST, metrics_url
from services.common.rpc import wait_for_health
from services.common.sizes import parse_bytes

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


RESTART_LIMIT = 5  # restarts of one child within a minute


@dataclass
class Child:
    name: str
    args: list[str]
    address: str  # where its health is checked
    health_service: str
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

    def start(self, name: str, args: list[str], address: str, health_service: str = "") -> Child:
        child = Child(name, args, address, health_service)
        self.children.append(child)
        self.launch(child)
        return child

    def launch(self, child: Child, timeout_s: float = 600) -> None:
        """Start the child's process and wait until it reports SERVING."""
        command = [sys.executable, "-m", "services.cli", *child.args]
        # A session of its own: a terminal's Ctrl-C reaches only this launcher, which stops children in order.
        child.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            preexec_fn=_die_with_parent,
            start_new_session=True,
        )
        threading.Thread(
            target=self._relay, args=(child, child.proc), name=f"log-{child.name}", daemon=True
        ).start()
        deadline = time.monotonic() + timeout_s
        while True:
            dead = self.first_dead()  # this child, or one started before it
            if dead is not None:
                raise ChildDied(dead)
            if self.stopping.is_set():
                raise Interrupted(f"stopped while {child.name} was starting")
            try:
                wait_for_health(child.address, 1.0, child.health_service)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{child.name} did not report SERVING within {timeout_s:.0f}s"
                    ) from None

    def restart(self, child: Child) -> None:
        """Start a dead child again, unless it was restarted RESTART_LIMIT times within the last minute."""
        now = time.monotonic()
        child.deaths = [t for t in child.deaths if now - t < 60.0] + [now]
        if len(child.deaths) > RESTART_LIMIT:
            raise ChildDied(child, f"; it died {len(child.deaths)} times within a minute")
        self.say(f"{child.name} {child.exit_reason()}; starting it again")
        self.launch(child)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="the frontend's host (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="the frontend's port; 0 picks a free one")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the workers' dtype: auto is float32 on the CPU, bfloat16 on CUDA",
    )
    parser.add_argument("--workers", type=int, default=1, help="compute workers sharing the pool")
    parser.add_argument(
        "--kv-memory", type=parse_bytes, default=2**30, help="the KV pool's size (default: 1GiB)"
    )
    parser.add_argument("--max-batched-tokens", type=int, help="the workers' token budget a step")
    parser.add_argument("--max-num-seqs", type=int, help="the workers' most sequences a step")
    parser.add_argument("--max-running", type=int, help="the frontend's requests in workers at once")
    parser.add_argument("--max-waiting", type=int, help="the frontend's queue behind them")
    parser.add_argument(
        "--no-metrics", action="store_true", help="serve no Prometheus metrics (default: each process does)"
    )
    parser.add_argument(
        "--run-dir", type=Path, help="where the internal unix sockets go (default: a new temp dir)"
    )
    parser.add_argument("--no-restart", action="store_true", help="stop the stack when a child dies")
    parser.add_argument("--api-token-file", help="the frontend requires this bearer token")
    parser.add_argument(
        "--tls-cert", help="the frontend serves TLS with this PEM certificate (and --tls-key)"
    )
    parser.add_argument("--tls-key", help="the PEM private key of --tls-cert")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="pagedserve-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    # Every child inherits the run's shared secret; one already set in the environment is kept.
    env = {**os.environ, SECRET_ENV: os.environ.get(SECRET_ENV) or secrets.token_urlsafe(32)}
    launcher = Launcher(run_dir, env)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: launcher.stopping.set())
    address = f"{args.host}:{args.port or _free_port(args.host)}"
    try:
        endpoints = _start_stack(launcher, args, address)
        _write_json(run_dir / "endpoints.json", endpoints)
        launcher.say(f"pagedserve is up on {address} with {args.workers} worker(s); Ctrl-C stops it")
        if not args.no_metrics:
            named = [("frontend", endpoints["frontend"]), ("daemon", endpoints["daemon"])]
            named += [(worker["name"], worker) for worker in endpoints["workers"]]
            launcher.say("metrics: " + ", ".join(f"{name} {where['metrics']}" for name, where in named))
        while not launcher.stopping.wait(0.2):
            dead = launcher.first_dead()
            if dead is not None:
                if args.no_restart:
                    raise ChildDied(dead)
                launcher.restart(dead)
        launcher.say("stopping: the frontend drains first")
        return 0
    except Interrupted as exc:
        launcher.say(str(exc))
        return 0
    except (ChildDied, TimeoutError) as exc:
        launcher.say(f"{exc}; stopping the rest")
        return 1
    finally:
        launcher.stop_all()
        if args.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


def _start_stack(launcher: Launcher, args: argparse.Namespace, address: str) -> dict[str, Any]:
    """Start every process in order; returns their endpoints, as endpoints.json holds them."""
    common = ["--log-level", args.log_level]
    model = ["--model", args.model] if args.model else []

    def metrics() -> tuple[list[str], str | None]:
        if args.no_metrics:
            return [], None
        port = _free_port(METRICS_HOST)
        return ["--metrics-port", str(port)], metrics_url(port)

    daemon_address = f"unix:{launcher.run_dir}/daemon.sock"
    daemon_flags, daemon_metrics = metrics()
    daemon = ["daemon", "--address", daemon_address, "--device", args.device, *daemon_flags, *common]
    launcher.start("daemon", daemon, daemon_address)
    workers: list[dict[str, str | None]] = []
    for i in range(args.workers):
        worker_address = f"unix:{launcher.run_dir}/worker-{i}.sock"
        worker = ["worker", "--name", f"worker-{i}", "--address", worker_address, "--daemon", daemon_address]
        worker += [
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--kv-memory",
            str(args.kv_memory),
            *model,
            *common,
        ]
        worker += _given_flags(args, "max_batched_tokens", "max_num_seqs")
        worker_flags, worker_metrics = metrics()
        launcher.start(f"worker-{i}", worker + worker_flags, worker_address)
        workers.append({"name": f"worker-{i}", "address": worker_address, "metrics": worker_metrics})
    frontend_flags, frontend_metrics = metrics()  # picked just before use: a free port may not stay free
    local_address = f"unix:{launcher.run_dir}/frontend.sock"
    frontend = ["frontend", "--address", address, "--local-address", local_address, *frontend_flags]
    frontend += [*model, *common, *(arg for worker in workers for arg in ("--worker", worker["address"]))]
    frontend += _given_flags(args, "api_token_file", "tls_cert", "tls_key", "max_running", "max_waiting")
    launcher.start("frontend", frontend, local_address, "pagedserve.v1.Generation")
    return {
        "frontend": {"address": address, "metrics": frontend_metrics},
        "daemon": {"address": daemon_address, "metrics": daemon_metrics},
        "workers": workers,
    }


def _given_flags(args: argparse.Namespace, *names: str) -> list[str]:
    """The options among names that the user gave, as flags to pass on to a child."""
    given = [(name, getattr(args, name)) for name in names if getattr(args, name) is not None]
    return [arg for name, value in given for arg in (f"--{name.replace('_', '-')}", str(value))]


def _write_json(path: Path, value: object) -> None:
    """Write whole or not at all: a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=2) + "\n")
    partial.replace(path)


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
