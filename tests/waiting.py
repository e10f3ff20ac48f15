"""Waiting in tests for something observable, never for a guessed length of time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    interval_s: float = 0.02,
) -> T:
    """Call condition every interval_s until it returns something truthy, and return that.

    Past timeout_s, fail with an AssertionError that names what was awaited; when `what` is callable it is
    called then, so that the message shows the last state observed (the load, the counts, the log). The
    condition is always tried once more after the deadline, so a slow poll cannot fail a condition that
    holds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        expired = time.monotonic() >= deadline
        if result := condition():
            return result
        if expired:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {_describe(what)}")
        time.sleep(interval_s)  # the poll interval: what is awaited happens in another process or thread


def _describe(what: str | Callable[[], str]) -> str:
    if not callable(what):
        return what
    try:
        return what()
    except Exception as exc:  # the state cannot be read (a process gone?): still fail on the timeout
        return f"a condition whose state could not be read: {exc!r}"
