"""tests/waiting.py: the one way tests wait for something to happen."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import wait_until


def test_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_until(lambda: [n] if (n := next(calls)) >= 3 else [], 5, "three calls", interval_s=0) == [3]


def test_a_timeout_names_what_was_awaited_and_the_last_state() -> None:
    state = iter(range(100))
    with pytest.raises(AssertionError, match=r"timed out after 0\.05s waiting for the count to reach 1000"):
        wait_until(lambda: False, 0.05, "the count to reach 1000")
    with pytest.raises(AssertionError, match=r"waiting for a load of 0; the load is \d+$"):
        wait_until(lambda: False, 0.05, lambda: f"a load of 0; the load is {next(state)}")


def test_the_condition_is_tried_once_more_at_the_deadline() -> None:
    calls = itertools.count()
    # A zero timeout still asks once: a condition that already holds never fails.
    assert wait_until(lambda: next(calls) == 0, 0, "the first call")


def test_a_state_that_cannot_be_read_still_fails_on_the_timeout() -> None:
    def broken() -> str:
        raise ConnectionError("the worker is gone")

    with pytest.raises(AssertionError, match="could not be read: ConnectionError"):
        wait_until(lambda: None, 0.01, broken)
