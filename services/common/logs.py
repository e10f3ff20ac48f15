"""Logging set-up: one line per record, tagged with the process's role so interleaved logs stay readable."""

from __future__ import annotations

import logging


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
