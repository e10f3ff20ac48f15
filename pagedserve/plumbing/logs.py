"""Logging set-up: one line per record, tagged with the process's role so interleaved logs stay readable."""

from __future__ import annotations

import logging
from typing import Any

from pagedserve.plumbing.settings import setting

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level_setting() -> Any:
    """A config field for the process's log level."""
    return setting("INFO", "the least severe log records printed", check=_check_level)


def _check_level(level: str) -> str | None:
    return None if level.upper() in LEVELS else f"must be one of {', '.join(LEVELS)}, got {level!r}"


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
