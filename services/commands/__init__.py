"""The client commands of `pagedserve`: generate, chat and health."""

from __future__ import annotations

import argparse
from typing import Any

from services.client import DEFAULT_ADDRESS, Client


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="the frontend (default: %(default)s)")
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for the server to come up first",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    # Greedy by default: even at temperature 0.2 the default 135M model starts its answer to
    # "What is the capital of France?" in French a third of the time.
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=0.9, help="when sampling (default: %(default)s)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--token", help="the frontend's bearer token (default: $PAGEDSERVE_API_TOKEN)")
    parser.add_argument("--tls-ca", help="a PEM CA file: reach a frontend that serves TLS")


def client_from_args(args: argparse.Namespace) -> Client:
    return Client(args.address, token=args.token, tls_ca=args.tls_ca)


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    sampling: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
    }
    if args.seed is not None:
        sampling["seed"] = args.seed
    return sampling
