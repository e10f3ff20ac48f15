"""The frontend's configuration: one frozen dataclass, whose fields are also its command-line flags."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from pagedserve.plumbing.auth import API_TOKEN_ENV, bearer_tokens, read_secret_file, secret_setting
from pagedserve.plumbing.logs import log_level_setting
from pagedserve.plumbing.metrics import MetricsSettings
from pagedserve.plumbing.settings import check_settings, nested, not_negative, positive, setting
from pagedserve.plumbing.sizes import parse_bytes

# The frontend's grpc.health.v1 service that is SERVING while every worker it was given accepts requests,
# where pagedserve.v1.Generation needs one: `up` starts the frontend beside the workers and waits on it.
EVERY_WORKER_HEALTH = "pagedserve.frontend.EveryWorker"


def _unix_socket(address: str) -> str | None:
    return None if address.startswith("unix:") else f"must be a unix socket (unix:/path), got {address}"


def _share(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be more than 0 and at most 1, got {value}"


def _host_and_port(address: str) -> str | None:
    """A gateway is told this address, so it names a port; SMG reaches workers over TCP only."""
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and 0 < int(port) < 65536 and not address.startswith("unix:"):
        return None
    return f"must be host:port with a port of its own (SMG reaches workers over TCP), got {address}"


@dataclass(frozen=True)
class FrontendConfig:
    address: str = setting("127.0.0.1:50051", "host:port to serve; 0.0.0.0:50051 serves other machines")
    workers: tuple[str, ...] = setting(
        ("127.0.0.1:50053",),
        "a worker's address; repeat for several",
        flag="--worker",
        metavar="ADDRESS",
        shown_default="127.0.0.1:50053",
    )
    model: str | None = setting(None, "the model folder, for its tokenizer (default: SmolLM2-135M-Instruct)")
    model_id: str | None = setting(
        None,
        "the model's name, as clients see it and as its workers must report it (default: a worker's, from "
        "the folder)",
    )
    daemon: str | None = setting(
        None, "the node's memory daemon, whose cached pages a gateway follows (SubscribeKvEvents, FlushCache)"
    )
    gateway_address: str | None = setting(
        None,
        "host:port of the gateway's own listener: SMG's worker protocol whole, with the node's control "
        "surface (KV events, cache flush, Abort by id) that the public --address refuses; a caller from "
        "this machine must run as this user or root, and others are whoever the network lets reach it",
        check=_host_and_port,
    )
    max_running: int = setting(256, "requests in workers at once", check=positive)
    max_waiting: int = setting(
        1024, "requests queued behind them; more are refused with RESOURCE_EXHAUSTED", check=not_negative
    )
    client_share: float = setting(
        0.5,
        "the most of --max-running, and of --max-waiting, that one client (its bearer token, else its "
        "address) may hold; the gateway listener's requests count toward the totals only",
        check=_share,
    )
    min_priority: int = setting(
        0, "the most favourable priority a request may ask for (lower runs first); lower is INVALID_ARGUMENT"
    )
    max_priority: int = setting(1000, "the least favourable priority a request may ask for")
    max_message_bytes: int = setting(
        4 * 2**20,
        "the largest request message the public port takes; gRPC refuses a larger one with "
        "RESOURCE_EXHAUSTED before reading it into a message",
        flag="--max-message-size",
        convert=parse_bytes,
        check=positive,
        shown_default="4MiB",
    )
    max_concurrent_streams: int = setting(
        256,
        "calls one HTTP/2 connection may have open at once on the public port; gRPC refuses one over it "
        "(UNAVAILABLE: REFUSED_STREAM), as its clients do not always wait for a free one",
        check=positive,
    )
    max_connections: int = setting(
        0,
        "TCP connections the public port keeps open at once; more are closed as they come (0: as many as "
        "the open-file limit allows, at three files each, 1024 kept for the rest)",
        check=not_negative,
    )
    max_client_connections: int = setting(
        128,
        "of those, the most that one client address may hold open (a proxy in front is one address: raise "
        "it for one)",
        check=positive,
    )
    default_max_tokens: int = setting(256, "max_tokens of a request that sets none", check=positive)
    tokenizer_threads: int = setting(2, "threads that tokenize requests; more wait for one", check=positive)
    drain_timeout_s: float = setting(
        30.0,
        "seconds a stream's next message may wait for the client to read it before the call is cancelled",
        flag="--drain-timeout",
        check=positive,
    )
    worker_timeout_s: float = setting(
        5.0,
        "seconds a worker may send nothing (frozen, stuck) before its requests move to another worker",
        flag="--worker-timeout",
        check=positive,
    )
    max_failovers: int = setting(
        2,
        "times a request may move to another worker when its own fails; then it is given up, in case it is "
        "what kills them",
        check=not_negative,
    )
    shutdown_grace_s: float = 10.0
    metrics: MetricsSettings = nested(MetricsSettings)
    secret: str | None = secret_setting()  # presented to workers
    api_token: str | None = setting(
        None,
        "a file holding the bearer tokens that clients must present, one a line (each a client of its own)",
        flag="--api-token-file",
        convert=read_secret_file,
        env=API_TOKEN_ENV,
        metavar="FILE",
        secret=True,
    )
    tls_cert: str | None = setting(
        None, "a PEM certificate chain: serve TLS (with --tls-key)", metavar="FILE"
    )
    tls_key: str | None = setting(None, "the PEM private key of --tls-cert", metavar="FILE")
    # `pagedserve up` checks health on this socket, whatever name the certificate carries.
    local_address: str | None = setting(
        None,
        "also serve on this unix socket (unix:/path), without TLS, for this machine's tools",
        check=_unix_socket,
    )
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.workers:
            raise ValueError("the frontend needs at least one --worker")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.min_priority > self.max_priority:
            raise ValueError(
                f"--min-priority {self.min_priority} is above --max-priority {self.max_priority}"
            )
        if self.api_token is not None and not self.api_tokens:
            raise ValueError("the --api-token-file holds no token")

    @property
    def api_tokens(self) -> tuple[str, ...]:
        return bearer_tokens(self.api_token)

    def tls_context(self) -> ssl.SSLContext | None:
        """The public port's TLS, which the HTTP/2 guard in front of gRPC terminates (`h2_guard`)."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2  # what gRPC asks for
        context.load_cert_chain(self.tls_cert, self.tls_key)
        context.set_alpn_protocols(["h2"])  # gRPC clients insist on it
        return context
