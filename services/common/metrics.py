"""Prometheus metrics over HTTP, shared by the three processes.

Each process registers its metrics on prometheus_client's default registry (which also carries the
process_* and python_* collectors) and, when given `--metrics-port`, serves them from a daemon thread at
http://127.0.0.1:PORT/metrics; `--metrics-host 0.0.0.0` opens them to a scraper in another container or on
another host. Metrics whose source lives on another thread (the daemon's event loop, the worker's engine
thread) are read from snapshots of plain numbers that their owner refreshes, never by iterating the owner's
structures from the scrape thread.
"""

from __future__ import annotations

import argparse
import logging

from prometheus_client import start_http_server

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


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """The three processes' --metrics-port and --metrics-host."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics on PORT/metrics (default: 0, none)",
    )
    parser.add_argument(
        "--metrics-host",
        default=METRICS_HOST,
        help="the metrics server's interface; 0.0.0.0 lets other hosts scrape (default: %(default)s)",
    )


def check_metrics_port(port: int) -> None:
    """For the configs' checks: 0 (no metrics server) or a TCP port."""
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be 0 (no metrics server) or a TCP port, got {port}")
