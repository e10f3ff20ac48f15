"""`python -m memory_daemon`: the daemon alone, with the same flags as `pagedserve daemon`."""

import argparse
import sys

from memory_daemon import server
from pagedserve.plumbing import settings

parser = argparse.ArgumentParser(prog="pagedserve daemon", description=server.__doc__)
settings.add_arguments(parser, server.CONFIG)
sys.exit(server.run(settings.configure(parser, server.CONFIG, parser.parse_args())))
