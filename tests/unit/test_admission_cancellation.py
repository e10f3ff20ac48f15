"""Admission under cancellation and failure: a waiter or holder that is cancelled or raises never loses a
slot.

Every test drives one event loop with asyncio.run (no pytest plugin) under a short overall timeout, so a
lost slot shows up as a failure instead of a hang (tests/unit/admitting.py). Waiting requests are tasks that
record their name when they enter their slot; the order of that record is the order in which slots were
handed out.
"""

from __future__ import annotations

import asyncio

import pytest

from services.frontend.admission import Admission
from tests.unit.admitting import Gate, assert_idle, enqueue, enqueue_in_order, run, settle

# Cancellation and failure ---------------------------------------------------------------------------------


def test_waiter_cancelled_while_waiting_leaves_the_queue() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=3)
        entered: list[str] = []
        holder = Gate(admission)
        await settle()
        tasks = await enqueue_in_order(admission, entered, [("a", 0), ("b", 0), ("c", 0)])
        tasks["b"].cancel()
        await settle()
        assert tasks["b"].cancelled()
        assert (admission.running, admission.waiting) == (1, 2)

        holder.open()
        await asyncio.gather(holder.task, tasks["a"], tasks["c"])
        assert entered == ["a", "c"]
        assert_idle(admission)

    run(scenario)


def test_cancelled_waiter_frees_room_in_the_queue() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=1)
        entered: list[str] = []
        holder = Gate(admission)
        await settle()
        first = enqueue(admission, entered, "first")
        await settle()
        first.cancel()
        await settle()
        second = enqueue(admission, entered, "second")  # fits: the cancelled one left its place
        await settle()
        assert (admission.running, admission.waiting) == (1, 1)
        holder.open()
        await asyncio.gather(holder.task, second)
        assert first.cancelled()
        assert entered == ["second"]
        assert_idle(admission)

    run(scenario)


def test_slot_handed_to_a_waiter_cancelled_at_that_moment_is_passed_on() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=3)
        entered: list[str] = []
        async with admission.slot(0, "a"):
            tasks = await enqueue_in_order(admission, entered, [("a", 0), ("b", 0)])
            assert (admission.running, admission.waiting) == (1, 2)
        # Leaving the block handed the slot to "a", which has not run yet: cancel it now.
        assert (admission.running, admission.waiting) == (1, 1)
        tasks["a"].cancel()
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert tasks["a"].cancelled()
        assert results[1] is None
        assert entered == ["b"]
        assert_idle(admission)

    run(scenario)


def test_slot_handed_to_the_last_waiter_cancelled_at_that_moment_is_freed() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=1)
        entered: list[str] = []
        async with admission.slot(0, "a"):
            only = enqueue(admission, entered, "only")
            await settle()
        only.cancel()
        await asyncio.gather(only, return_exceptions=True)
        assert only.cancelled()
        assert entered == []
        assert_idle(admission)
        async with admission.slot(0, "a"):  # the slot is usable again
            assert admission.running == 1
        assert_idle(admission)

    run(scenario)


def test_waiter_cancelled_just_as_the_slot_is_released() -> None:
    # Task.cancel() cancels the `turn` future at once, but the waiter runs its `except CancelledError` only
    # later. If a holder releases in between, _release pops the cancelled entry and skips it; the waiter must
    # still end with CancelledError (not an INTERNAL error upstream) and the slot must go to the next waiter.
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=3)
        entered: list[str] = []
        holder = Gate(admission)
        await settle()
        tasks = await enqueue_in_order(admission, entered, [("cancelled", 0), ("next", 0)])
        holder.open()  # the holder runs (and releases) before the cancelled waiter gets to run
        tasks["cancelled"].cancel()
        results = await asyncio.gather(holder.task, *tasks.values(), return_exceptions=True)
        assert results[0] is None
        assert results[2] is None
        assert entered == ["next"]
        assert_idle(admission)
        assert isinstance(results[1], asyncio.CancelledError), f"the cancelled waiter raised {results[1]!r}"

    run(scenario)


def test_exception_in_the_body_releases_the_slot() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=1)
        with pytest.raises(RuntimeError) as info:
            async with admission.slot(0, "a"):
                assert admission.running == 1
                raise RuntimeError("boom")
        assert str(info.value) == "boom"
        assert_idle(admission)

    run(scenario)


def test_exception_in_the_body_hands_the_slot_to_a_waiter() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=1)
        entered: list[str] = []
        failing_can_go = asyncio.Event()

        async def failing() -> None:
            async with admission.slot(0, "a"):
                await failing_can_go.wait()
                raise RuntimeError("boom")

        failer = asyncio.create_task(failing())
        await settle()
        waiter = enqueue(admission, entered, "waiter")
        await settle()
        assert (admission.running, admission.waiting) == (1, 1)
        failing_can_go.set()
        results = await asyncio.gather(failer, waiter, return_exceptions=True)
        assert isinstance(results[0], RuntimeError)
        assert results[1] is None
        assert entered == ["waiter"]
        assert_idle(admission)

    run(scenario)


def test_cancelling_a_running_request_releases_its_slot() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=1)
        entered: list[str] = []
        holder = Gate(admission)
        await settle()
        waiter = enqueue(admission, entered, "waiter")
        await settle()
        holder.task.cancel()
        await asyncio.gather(holder.task, waiter, return_exceptions=True)
        assert holder.task.cancelled()
        assert entered == ["waiter"]
        assert_idle(admission)

    run(scenario)
