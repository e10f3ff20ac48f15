"""The frontend's configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.metrics import METRICS_HOST, check_metrics_port


@dataclass(frozen=True)
class FrontendConfig:
    address: str = "127.0.0.1:50051"  # the public port; 0.0.0.0:50051 to serve other machines
    workers: tuple[str, ...] = ("127.0.0.1:50053",)
    model: str | None = None  # for the tokenizer and chat template; None means the default model
    max_running: int = 256  # requests in workers at once
    max_waiting: int = 1024  # requests queued behind them; more are refused with RESOURCE_EXHAUSTED
    default_max_tokens: int = 256
    shutdown_grace_s: float = 10.0
    metrics_port: int = 0  # Prometheus /metrics on metrics_host:PORT; 0 serves none
    metrics_host: str = METRICS_HOST
    secret: str | None = field(default=None, repr=False)  # presented to workers (services.common.auth)
    api_token: str | None = field(default=None, repr=False)  # clients must present it as a bearer token
    tls_cert: str | None = None  # PEM files: with both, the public port serves TLS
    tls_key: str | None = None
    # A unix socket serving the same without TLS, for this machine's tools: `pagedserve up` checks health
    # there, whatever name the certificate carries. The bearer token still applies.
    local_address: str | None = None

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("the frontend needs at least one --worker")
        if self.max_running < 1 or self.max_waiting < 0 or self.default_max_tokens < 1:
            raise ValueError("max_running and default_max_tokens must be positive, max_waiting not negative")
        check_metrics_port(self.metrics_port)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.local_address is not None and not self.local_address.startswith("unix:"):
            raise ValueError(f"--local-address must be a unix socket (unix:/path), got {self.local_address}")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
        return grpc.ssl_server_credentials([pair])
