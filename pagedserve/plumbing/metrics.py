"""Prometheus metrics over HTTP, shared by the three processes.

Each process registers its metrics on prometheus_client's default registry (which also carries the
process_* and python_* collectors) and, when given `--metrics-port`, serves them from a daemon thread at
http://127.0.0.1:PORT/metrics; `--metrics-host 0.0.0.0` opens them to a scraper in another container or on
another host. Metrics whose source lives on another thread (the daemon's event loop, the worker's engine
thread) are read from snapshots of plain numbers that their owner refreshes, never by iterating the owner's
structures from the scrape thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import start_http_server

from pagedserve.plumbing.settings import check_settings, setting, tcp_port

log = logging.getLogger(__name__)

METRICS_HOST = "127.0.0.1"  # loopback: the numbers are for this machine's scraper, not the world


def start_metrics_server(port: int, host: str = METRICS_HOST) -> int:
    """Serve the default registry at http://host:port/metrics; returns the bound port (0 picks a free one)."""
    server, _ = start_http_server(port, addr=host)
    return int(server.server_port)


def metrics_url(port: int, host: str = METRICS_HOST) -> str:
    return f"http://{host}:{port}/metrics"


def serve_metrics(port: int, host: str = METRICS_HOST) -> str | None:
    """Start the metrics server when port is set (0 means none) and log its URL; returns the URL."""
    if not port:
        return None
    url = metrics_url(start_metrics_server(port, host), host)
    log.info("metrics on %s", url)
    return url


def _port_or_none(port: int) -> str | None:
    return None if tcp_port(port) is None else f"must be 0 (no metrics server) or a TCP port, got {port}"


@dataclass(frozen=True)
class MetricsSettings:
    """Where a process serves its Prometheus metrics."""

    port: int = setting(
        0,
        "serve Prometheus metrics on http://HOST:PORT/metrics; 0 serves none",
        flag="--metrics-port",
        check=_port_or_none,
    )
    host: str = setting(
        METRICS_HOST,
        "the metrics server's interface; 0.0.0.0 lets other hosts scrape",
        flag="--metrics-host",
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def serve(self) -> str | None:
        """Start the metrics server when a port is set; returns its URL."""
        return serve_metrics(self.port, self.host)
