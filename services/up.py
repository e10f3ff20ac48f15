"""`pagedserve up`: the daemon, the workers and the frontend as separate OS processes on this machine.

Internal services talk over unix sockets in a private run folder; only the frontend listens on TCP, with
TLS and a bearer token if asked. A --run-dir must be a real folder of this user's that no one else may
enter (mode 0700), or not exist yet (then it is made so): other users must not be able to swap a socket
or plant a symlink in it. The internal calls carry a shared secret made fresh for each run and handed
to the children in their environment. Every flag of `pagedserve daemon`, `worker` and `frontend` works here
too, except those `up` sets itself (addresses, names, metrics ports): it is declared once, in that process's
config, and passed on to each child that has it (`--device` to the daemon and the workers, `--model` to the
workers and the frontend). If a child dies, the launcher says which one and why, and starts it again: a
worker re-attaches to the daemon's pool, whose cached prefixes outlive it, and after a daemon restart the
workers attach to the new one. Under --no-restart, or when one child keeps dying, the whole stack stops.
On a CPU, workers that share the machine share its cores: each gets its part as --threads, unless given.
Ctrl-C or SIGTERM drains the frontend, then stops the workers and the daemon, also while the stack is still
starting.

The launcher checks the frontend's health on a unix socket of its own (--local-address), so that a TLS
certificate issued for another name, or a wildcard --host, does not stand in the way.

Each child also serves Prometheus metrics on a free loopback port (unless --no-metrics). Once all are up,
`{run_dir}/endpoints.json` names every process's address and metrics URL, for tools such as the bench:
{"frontend": {"address", "metrics"}, "daemon": {"address", "metrics"}, "workers": [{"name", "address",
"metrics"}]}, with null metrics when they are off, the frontend's "gateway_address" (null without one),
and {"gateway": {"address", "metrics"}} under --gateway PORT, which puts SMG's OpenAI-compatible gateway
in front of the stack (`pagedserve gateway`), stopped first. SMG reaches the frontend's gateway listener
(--gateway-address, on a free loopback port unless given), the only one that serves it the node's KV
events; the public port refuses them to every client.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memory_daemon.config import DaemonConfig
from pagedserve.plumbing import settings
from pagedserve.plumbing.auth import SECRET_ENV
from pagedserve.plumbing.errors import PermissionDenied
from pagedserve.plumbing.metrics import METRICS_HOST, metrics_url
from pagedserve.plumbing.private import private_folder, write_private_file
from pagedserve.plumbing.rpc import CannotListen, listen_refusal
from pagedserve.plumbing.settings import positive, setting, tcp_port
from services.common.default_model import resolve_model
from services.frontend.config import EVERY_WORKER_HEALTH, FrontendConfig
from services.gateway import api_url
from services.launcher import Child, ChildDied, Interrupted, Launcher, free_port
from services.worker.config import WorkerConfig

# Set by `up` for each child, so not flags of `up`.
MANAGED = frozenset(
    ["--address", "--metrics-port", "--name", "--kv", "--daemon", "--worker", "--local-address"]
)
# The worker first: where several processes share a flag, --help shows the worker's words for it.
CHILDREN: dict[str, type] = {"worker": WorkerConfig, "daemon": DaemonConfig, "frontend": FrontendConfig}


@dataclass(frozen=True)
class StackConfig:
    """The settings of `up` itself; its children's come from their own configs."""

    host: str = setting("127.0.0.1", "the frontend's host")
    port: int = setting(50051, "the frontend's port; 0 picks a free one", check=tcp_port)
    workers: int = setting(1, "compute workers sharing the pool", check=positive)
    run_dir: str | None = setting(
        None, "a private folder (0700) for the internal unix sockets and endpoints.json (default: a new one)"
    )
    restart: bool = setting(True, "start a child that dies again (at most 5 times a minute)")
    metrics: bool = setting(True, "each process serves Prometheus metrics on a free loopback port")
    gateway: int | None = setting(
        None, "also serve the OpenAI API on this port: SMG's gateway in front of the stack", check=tcp_port
    )

    def __post_init__(self) -> None:
        settings.check_settings(self)


@dataclass(frozen=True)
class Plan:
    stack: StackConfig
    flags: dict[str, list[str]]  # the flags given for each kind of child, to pass on
    model: str | None = None  # for the gateway's tokenizer
    gateway_address: str | None = None  # the frontend's listener for a gateway, when given
    threads_each: int | None = None  # the torch threads `up` gave each worker, when it shared out the cores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, StackConfig)
    for config in CHILDREN.values():
        settings.add_arguments(parser, config, skip=MANAGED)


def configure(args: argparse.Namespace) -> Plan:
    """The stack's settings; the children's are checked now, so that a bad one is a usage error at once."""
    for config in CHILDREN.values():
        settings.from_args(config, args)
    flags = {name: settings.given_flags(config, args, skip=MANAGED) for name, config in CHILDREN.items()}
    stack = settings.from_args(StackConfig, args)
    frontend = settings.from_args(FrontendConfig, args)
    threads_each = shared_cores(stack, settings.from_args(WorkerConfig, args))
    if threads_each is not None:
        flags["worker"] += ["--threads", str(threads_each)]
    if stack.run_dir is not None:
        try:
            stack = replace(stack, run_dir=str(private_folder(stack.run_dir)))
        except PermissionDenied as exc:
            raise ValueError(
                f"--run-dir {stack.run_dir}: {exc}; give a folder of your own (mode 0700)"
            ) from None
    return Plan(stack, flags, frontend.model, frontend.gateway_address, threads_each)


def shared_cores(stack: StackConfig, worker: WorkerConfig) -> int | None:
    """The torch threads each CPU worker gets when several share this machine and --threads is not given:
    the cores this process may run on, shared out. Each worker's OpenMP threads spin between parallel ops,
    and two workers' teams spinning on the same cores stall each other: on 2 cores, 16 calls on 2 workers
    took steps of 684 ms with 2 threads each, and 79 ms with one."""
    if stack.workers == 1 or worker.device != "cpu" or worker.threads:
        return None
    return max(1, len(os.sched_getaffinity(0)) // stack.workers)


def run(plan: Plan) -> int:
    stack = plan.stack
    # Checked by configure, or made private by mkdtemp.
    run_dir = Path(stack.run_dir) if stack.run_dir else Path(tempfile.mkdtemp(prefix="pagedserve-"))
    # Every child inherits the run's shared secret; one already set in the environment is kept.
    env = {**os.environ, SECRET_ENV: os.environ.get(SECRET_ENV) or secrets.token_urlsafe(32)}
    launcher = Launcher(run_dir, env)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: launcher.stopping.set())
    address = f"{stack.host}:{stack.port or free_port(stack.host)}"
    try:
        if plan.model is not None:
            resolve_model(plan.model)  # a folder that is no model stops the start before any child
        endpoints = _start_stack(launcher, plan, address)
        _write_json(run_dir / "endpoints.json", endpoints)
        launcher.say(f"pagedserve is up on {address} with {stack.workers} worker(s); Ctrl-C stops it")
        if plan.threads_each is not None:
            launcher.say(
                f"the workers share the CPU's cores: {plan.threads_each} torch thread(s) each (--threads)"
            )
        if stack.metrics:
            named = [("frontend", endpoints["frontend"]), ("daemon", endpoints["daemon"])]
            named += [(worker["name"], worker) for worker in endpoints["workers"]]
            launcher.say("metrics: " + ", ".join(f"{name} {where['metrics']}" for name, where in named))
        while not launcher.stopping.wait(0.2):
            dead = launcher.first_dead()
            if dead is not None:
                if not stack.restart:
                    raise ChildDied(dead)
                launcher.restart(dead)
        launcher.say("stopping: the frontend drains first")
        return 0
    except Interrupted as exc:
        launcher.say(str(exc))
        return 0
    except (CannotListen, FileNotFoundError) as exc:
        launcher.say(f"cannot start: {exc}")
        return 1
    except (ChildDied, TimeoutError) as exc:
        launcher.say(f"{exc}; stopping the rest")
        return 1
    finally:
        launcher.stop_all()
        if stack.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


def _start_stack(launcher: Launcher, plan: Plan, address: str) -> dict[str, Any]:
    """Start every process in order; returns their endpoints, as endpoints.json holds them."""
    _check_public_addresses(plan, address)

    def metrics() -> tuple[list[str], str | None]:
        if not plan.stack.metrics:
            return [], None
        port = free_port(METRICS_HOST)  # picked just before use: a free port may not stay free
        return ["--metrics-port", str(port)], metrics_url(port)

    daemon_address = f"unix:{launcher.run_dir}/daemon.sock"
    daemon_flags, daemon_metrics = metrics()
    daemon = ["daemon", "--address", daemon_address, *daemon_flags, *plan.flags["daemon"]]
    launcher.start(Child("daemon", daemon, daemon_address))
    workers: list[dict[str, str | None]] = []
    worker_children: list[Child] = []
    for i in range(plan.stack.workers):
        name, worker_address = f"worker-{i}", f"unix:{launcher.run_dir}/worker-{i}.sock"
        worker_flags, worker_metrics = metrics()
        worker = ["worker", "--name", name, "--address", worker_address, "--daemon", daemon_address]
        worker_children.append(Child(name, [*worker, *worker_flags, *plan.flags["worker"]], worker_address))
        workers.append({"name": name, "address": worker_address, "metrics": worker_metrics})
    frontend_flags, frontend_metrics = metrics()
    local_address = f"unix:{launcher.run_dir}/frontend.sock"
    frontend = ["frontend", "--address", address, "--local-address", local_address, *frontend_flags]
    frontend += ["--daemon", daemon_address]
    frontend += [arg for worker in workers for arg in ("--worker", str(worker["address"]))]
    gateway_address = plan.gateway_address  # passed on with the frontend's flags
    if gateway_address is None and plan.stack.gateway is not None:
        gateway_address = f"127.0.0.1:{free_port('127.0.0.1')}"
        frontend += ["--gateway-address", gateway_address]
    frontend_child = Child(
        "frontend",
        [*frontend, *plan.flags["frontend"]],
        local_address,
        health_service="pagedserve.v1.Generation",
        start_health_service=EVERY_WORKER_HEALTH,  # it starts beside the workers, and reaches each
    )
    launcher.start(*worker_children, frontend_child)
    endpoints: dict[str, Any] = {}
    if plan.stack.gateway is not None:
        assert gateway_address is not None
        endpoints["gateway"] = _start_gateway(launcher, plan, plan.stack.gateway, gateway_address)
    return endpoints | {
        "frontend": {"address": address, "metrics": frontend_metrics, "gateway_address": gateway_address},
        "daemon": {"address": daemon_address, "metrics": daemon_metrics},
        "workers": workers,
    }


def _check_public_addresses(plan: Plan, address: str) -> None:
    """Raise CannotListen if this machine will not listen on an address the stack was told to take (the
    frontend's, the gateway's or its listener): checked before any child starts, where the frontend found
    out after the daemon and the workers had started (about 10 s). A port taken after this check still
    stops the process that wants it."""
    public = [address, plan.gateway_address]
    if plan.stack.gateway is not None:
        public.append(f"{plan.stack.host}:{plan.stack.gateway}")
    for where in filter(None, public):
        reason = listen_refusal(where)
        if reason is not None:
            raise CannotListen(where, reason)


def _start_gateway(launcher: Launcher, plan: Plan, port: int, listener: str) -> dict[str, str | None]:
    """SMG's gateway in front of the frontend's gateway listener; returns its OpenAI API's URL and its
    metrics' (SMG's own, such as the KV events it applied)."""
    url = api_url(plan.stack.host, port)
    # The listener as the gateway reaches it: by loopback when it listens on every interface.
    host, listener_port = listener.rsplit(":", 1)
    stack = api_url(host, int(listener_port)).removeprefix("http://")
    gateway = ["gateway", "--stack", stack, "--host", plan.stack.host, "--port", str(port)]
    metrics = None
    if plan.stack.metrics:
        metrics_port = free_port(METRICS_HOST)
        gateway += ["--metrics-port", str(metrics_port)]
        metrics = metrics_url(metrics_port)
    launcher.start(Child("gateway", gateway + (["--model", plan.model] if plan.model else []), url))
    return {"address": f"{url}/v1", "metrics": metrics}


def _write_json(path: Path, value: object) -> None:
    """Write whole or not at all, through no symlink: a reader never sees half a file."""
    write_private_file(path, json.dumps(value, indent=2) + "\n")
