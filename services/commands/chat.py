"""`pagedserve chat`: an interactive chat in the terminal. /reset forgets the conversation; Ctrl-D quits."""

from __future__ import annotations

import argparse
import sys

import grpc

from services.commands import add_client_arguments, client_from_args, sampling_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", help="a system message to start the conversation with")
    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    with client_from_args(args) as client:
        if args.wait:
            client.wait_ready(args.wait)
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print()
                return 0
            if not line:
                continue
            if line == "/reset":
                messages = list(start)
                continue
            messages.append({"role": "user", "content": line})
            print("model> ", end="", flush=True)
            answer = ""
            try:
                for reply in client.stream(messages=messages, **sampling_from_args(args)):
                    answer += reply.text
                    print(reply.text, end="", flush=True)
            except grpc.RpcError as exc:
                print(f"\npagedserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
                messages.pop()
                continue
            print()
            messages.append({"role": "assistant", "content": answer})
