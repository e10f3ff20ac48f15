"""The `pagedserve` command: one subcommand per process or client.

A process module (`memory_daemon.server`, `services.worker.server`, `services.frontend.server`) names its
config class as CONFIG, whose fields are its flags, and runs with `run(config)`. The other commands bring
`add_arguments(parser)` and `run(args)`, and `up` a `configure(args)` between the two.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedserve.plumbing import settings
from services.launcher import die_with_spawner

# subcommand -> (module, help)
COMMANDS = {
    "up": ("services.up", "run the whole stack: daemon, workers and frontend"),
    "daemon": ("memory_daemon.server", "run the KV memory daemon"),
    "worker": ("services.worker.server", "run a compute worker"),
    "frontend": ("services.frontend.server", "run the public gRPC frontend"),
    "gateway": ("services.gateway", "run SMG's OpenAI-compatible gateway in front of one or more stacks"),
    "generate": ("services.commands.generate", "stream an answer to a prompt"),
    "chat": ("services.commands.chat", "chat with the model in the terminal"),
    "health": ("services.commands.health", "check a server's grpc.health.v1 status"),
    "bench": ("services.commands.bench", "load a running stack and report latency, throughput and KV use"),
}


def main(argv: list[str] | None = None) -> int:
    die_with_spawner()
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
            if hasattr(module, "CONFIG"):
                settings.add_arguments(sub, module.CONFIG)
            else:
                module.add_arguments(sub)
            sub.set_defaults(module=module, usage=sub)
    args = parser.parse_args(argv)
    module = args.module
    if hasattr(module, "CONFIG"):
        return int(module.run(settings.configure(args.usage, module.CONFIG, args)))
    if hasattr(module, "configure"):
        try:
            plan = module.configure(args)
        except (ValueError, OSError) as error:  # a value out of range, an unreadable file
            args.usage.error(str(error))
        return int(module.run(plan))
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
