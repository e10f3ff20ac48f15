"""`pagedserve generate PROMPT`: stream the model's answer to the terminal.

The prompt goes through the model's chat template as a user message, unless --raw sends it as plain text.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from services.commands import add_client_arguments, client_from_args, sampling_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        try:
            if args.wait:
                client.wait_ready(args.wait)
            if args.raw:
                replies = client.stream(args.prompt, **sampling_from_args(args))
            else:
                messages = [{"role": "user", "content": args.prompt}]
                replies = client.stream(messages=messages, **sampling_from_args(args))
            for reply in replies:
                print(reply.text, end="", flush=True)
        except grpc.RpcError as exc:
            print(f"\npagedserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except TimeoutError as exc:
            print(f"pagedserve: {exc}", file=sys.stderr)
            return 1
    print()
    return 0
