"""`pagedserve gateway`: SMG's gateway in front of one or more pagedserve stacks, for OpenAI clients.

SMG (PyPI `smg`, the router vLLM and SGLang use for their gRPC workers) speaks the OpenAI and Anthropic HTTP
APIs, tokenizes and renders chats itself, and routes across workers. Each stack's frontend serves SMG's
vLLM worker protocol whole on its gateway listener (`pagedserve frontend --gateway-address`, the only
listener with the node's KV events, cache flush and aborts by id), so this command only starts
`smg launch --backend vllm` with one worker URL per stack's listener, the model folder for the tokenizer,
cache-aware routing (which follows each node's KV events, from its memory daemon), and health checks often
enough to route around a stack that dies. Flags after `--` go
to smg as they are. SIGINT and SIGTERM stop the gateway, which dies with this process.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagedserve.plumbing import settings
from pagedserve.plumbing.auth import read_secret_file
from pagedserve.plumbing.settings import positive, setting, tcp_port
from services.common.default_model import resolve_model
from services.launcher import die_with_parent, free_port, http_ready

SMG_PIN = "smg==1.13.0"
Policy = Literal["cache_aware", "prefix_hash", "least_load", "power_of_two", "round_robin", "random"]


@dataclass(frozen=True)
class GatewayConfig:
    stacks: tuple[str, ...] = setting(
        ("127.0.0.1:50052",),
        "a stack's gateway listener (host:port, its frontend's --gateway-address); repeat for several",
        flag="--stack",
        metavar="ADDRESS",
        shown_default="127.0.0.1:50052",
    )
    host: str = setting("127.0.0.1", "the host the OpenAI API listens on; 0.0.0.0 serves other machines")
    port: int = setting(30000, "the OpenAI API's port", check=tcp_port)
    model: str | None = setting(None, "the model folder, for its tokenizer (default: SmolLM2-135M-Instruct)")
    policy: Policy = setting("cache_aware", "how SMG picks a stack for each request")
    health_check_interval_s: int = setting(
        2, "seconds between SMG's health checks of a stack", flag="--health-check-interval", check=positive
    )
    log_level: Literal["debug", "info", "warn", "error"] = setting("warn", "SMG's log level")
    metrics_port: int = setting(0, "SMG's Prometheus metrics, on this loopback port; 0 picks a free one")
    api_key: str | None = setting(
        None,
        "a file holding the key that OpenAI clients must present (Authorization: Bearer KEY)",
        flag="--api-key-file",
        convert=read_secret_file,
        metavar="FILE",
        secret=True,
    )

    def __post_init__(self) -> None:
        settings.check_settings(self)
        if not self.stacks:
            raise ValueError("the gateway needs at least one --stack")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, GatewayConfig)
    parser.add_argument("smg_args", nargs="*", metavar="-- SMG_FLAG", help="flags passed to smg as they are")


@dataclass(frozen=True)
class Plan:
    config: GatewayConfig
    command: list[str]  # smg's


def configure(args: argparse.Namespace) -> Plan:
    """The gateway's settings and smg command line; a usage error when smg is not installed."""
    config = settings.from_args(GatewayConfig, args)
    return Plan(config, smg_command(config, args.smg_args))


def smg_command(config: GatewayConfig, extra: Sequence[str] = ()) -> list[str]:
    """The `smg launch` command line for config."""
    return [
        smg_binary(),
        "launch",
        "--backend",
        "vllm",
        "--worker-urls",
        *(f"grpc://{address}" for address in config.stacks),
        "--model-path",
        str(resolve_model(config.model)),
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--policy",
        config.policy,
        "--health-check-interval-secs",
        str(config.health_check_interval_s),
        "--shutdown-grace-period-secs",
        "10",
        "--prometheus-host",
        "127.0.0.1",  # SMG's default is every interface, unauthenticated
        "--prometheus-port",
        str(config.metrics_port or free_port("127.0.0.1")),
        # Its control plane (registering backends by URL, flushing caches) answers only this key, which
        # nobody holds: the stacks are given here, and nobody else may add one.
        "--control-plane-api-keys",
        f"pagedserve:pagedserve:admin:{secrets.token_urlsafe(32)}",
        *(["--api-key", config.api_key] if config.api_key else []),
        "--log-level",
        config.log_level,
        *extra,
    ]


def run(plan: Plan) -> int:
    # SMG is no Python process to ask for its own PR_SET_PDEATHSIG (spawn); nothing here has used gRPC yet.
    proc = subprocess.Popen(plan.command, preexec_fn=die_with_parent)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: proc.send_signal(signal.SIGTERM))
    url = api_url(plan.config.host, plan.config.port)
    while proc.poll() is None and not http_ready(url):
        time.sleep(0.2)
    if proc.poll() is None:
        stacks = ", ".join(plan.config.stacks)
        print(f"gateway: the OpenAI API is up on {url}/v1, in front of {stacks}", flush=True)
    return proc.wait()


def api_url(host: str, port: int) -> str:
    return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"


def smg_binary() -> str:
    beside = Path(sys.executable).with_name("smg")  # this virtual environment's, whether on PATH or not
    found = str(beside) if beside.is_file() else shutil.which("smg")
    if found is None:
        raise ValueError(f"the gateway is SMG's `smg`, which is not installed: pip install '{SMG_PIN}'")
    return found
