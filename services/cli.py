"""The `pagedserve` command: one subcommand per process or client."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments and run, help)
COMMANDS = {
    "up": ("services.launcher", "run the whole stack: daemon, workers and frontend"),
    "daemon": ("memory_daemon.server", "run the KV memory daemon"),
    "worker": ("services.worker.server", "run a compute worker"),
    "frontend": ("services.frontend.server", "run the public gRPC frontend"),
    "generate": ("services.commands.generate", "stream an answer to a prompt"),
    "chat": ("services.commands.chat", "chat with the model in the terminal"),
    "health": ("services.commands.health", "check a server's grpc.health.v1 status"),
    "bench": ("services.commands.bench", "load a running stack and report latency, throughput and KV use"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="An LLM inference server over a shared paged KV pool."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if argv and argv[0] == name:  # import only what the chosen command needs: torch is slow to load
            module = importlib.import_module(module_name)
            sub.description = module.__doc__
            module.add_arguments(sub)
            # A process module also has config_from_args, whose errors are told as usage, not a traceback.
            sub.set_defaults(run=module.run, configure=getattr(module, "config_from_args", None), usage=sub)
    args = parser.parse_args(argv)
    if args.configure is None:
        return args.run(args)
    try:
        config = args.configure(args)
    except (ValueError, OSError) as error:  # a value out of range, an unreadable secret file
        args.usage.error(str(error))
    return args.run(args, config)


if __name__ == "__main__":
    sys.exit(main())
