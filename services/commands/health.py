"""`pagedserve health ADDRESS`: exit 0 when the server reports SERVING (for container healthchecks)."""

from __future__ import annotations

import argparse
import sys

from pagedserve.plumbing.rpc import wait_for_health
from services.client import tls_credentials


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="host:port or unix:/path")
    parser.add_argument("--service", default="", help="the service to ask about (default: the server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--tls-ca", help="a PEM CA file: check a frontend that serves TLS")


def run(args: argparse.Namespace) -> int:
    try:
        wait_for_health(args.address, args.timeout, args.service, tls_credentials(args.tls_ca))
    except TimeoutError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 1
    return 0
