"""The `pagedserve` command: one subcommand per process or client."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments and run, help)
COMMANDS = {
    "daemon": ("memory_daemon.server", "run the KV memory daemon"),
    "worker": ("services.worker.server", "run a compute worker"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="An LLM inference server over a shared paged KV pool."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
