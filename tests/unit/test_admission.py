"""Admission: running slots and a bounded priority queue behind them, granted by priority then arrival.

Every test drives one event loop with asyncio.run (no pytest plugin) under a short overall timeout, so a
lost slot shows up as a failure instead of a hang (tests/unit/admitting.py). Waiting requests are tasks that
record their name when they enter their slot; the order of that record is the order in which slots were
handed out.
"""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.plumbing.errors import ResourceExhausted
from services.frontend.admission import Admission
from tests.unit.admitting import Gate, assert_idle, enqueue_in_order, run, settle

# Construction ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_running", "max_waiting", "share"), [(0, 1, 1), (-1, 1, 1), (1, -1, 1), (1, 1, 0), (1, 1, 1.5)]
)
def test_invalid_construction(max_running: int, max_waiting: int, share: float) -> None:
    with pytest.raises(ValueError) as info:
        Admission(max_running, max_waiting, share)
    assert str(info.value) == "max_running must be positive, max_waiting not negative, client_share in (0, 1]"


def test_valid_construction() -> None:
    admission = Admission(1, 0)
    assert (admission.max_running, admission.max_waiting) == (1, 0)
    assert_idle(admission)


# Granting and ordering ------------------------------------------------------------------------------------


def test_slots_up_to_max_running_are_granted_at_once() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=3, max_waiting=4)
        gates = [Gate(admission) for _ in range(3)]
        await settle()
        assert [g.entered for g in gates] == [True, True, True]
        assert (admission.running, admission.waiting) == (3, 0)

        late = Gate(admission)
        await settle()
        assert late.entered is False
        assert (admission.running, admission.waiting) == (3, 1)

        gates[1].open()
        await settle()
        assert late.entered is True
        assert (admission.running, admission.waiting) == (3, 0)  # the slot was handed over, not freed

        for gate in [*gates, late]:
            gate.open()
        await asyncio.gather(*(g.task for g in [*gates, late]))
        assert_idle(admission)

    run(scenario)


def test_waiters_enter_by_priority_then_arrival() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_running=1, max_waiting=10)
        entered: list[str] = []
        holder = Gate(admission)
        await settle()
        requests = [
            ("p5", 5),
            ("p1-first", 1),
            ("p3-first", 3),
            ("p1-second", 1),
            ("p0", 0),
            ("p3-second", 3),
        ]
        tasks = await enqueue_in_order(admission, entered, requests)
        assert (admission.running, admission.waiting) == (1, 6)
        assert entered == []
        holder.open()
        await asyncio.gather(holder.task, *tasks.values())
        assert_idle(admission)
        return entered

    assert run(scenario) == ["p0", "p1-first", "p1-second", "p3-first", "p3-second", "p5"]


def test_negative_priority_goes_first() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_running=1, max_waiting=3)
        entered: list[str] = []
        holder = Gate(admission)
        await settle()
        tasks = await enqueue_in_order(admission, entered, [("zero", 0), ("minus", -7), ("plus", 7)])
        holder.open()
        await asyncio.gather(holder.task, *tasks.values())
        return entered

    assert run(scenario) == ["minus", "zero", "plus"]


def test_released_slot_passes_down_the_queue() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_running=2, max_waiting=4)
        entered: list[str] = []
        first, second = Gate(admission), Gate(admission)
        await settle()
        tasks = await enqueue_in_order(admission, entered, [("low", 9), ("lower", 8)])
        first.open()  # hands its slot to "lower", which leaves at once and hands it to "low"
        await settle()
        assert entered == ["lower", "low"]
        assert (admission.running, admission.waiting) == (1, 0)
        second.open()
        await asyncio.gather(first.task, second.task, *tasks.values())
        assert_idle(admission)
        return entered

    assert run(scenario) == ["lower", "low"]


# The queue bound ------------------------------------------------------------------------------------------


def test_full_queue_refuses_at_once() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=2)
        entered: list[str] = []
        holder = Gate(admission)
        await settle()
        tasks = await enqueue_in_order(admission, entered, [("a", 0), ("b", 0)])
        assert (admission.running, admission.waiting) == (1, 2)

        for priority in (0, -100):  # a better priority does not get past a full queue
            with pytest.raises(ResourceExhausted) as info:
                async with admission.slot(priority, "a"):
                    pytest.fail("a request past the queue bound got a slot")
            assert str(info.value) == "the server is full: 1 requests running and 2 queued; retry later"
            assert (admission.running, admission.waiting) == (1, 2)

        holder.open()
        await asyncio.gather(holder.task, *tasks.values())
        assert entered == ["a", "b"]
        assert_idle(admission)

    run(scenario)


def test_zero_waiting_refuses_when_running_is_full() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=2, max_waiting=0)
        gates = [Gate(admission), Gate(admission)]
        await settle()
        with pytest.raises(ResourceExhausted) as info:
            async with admission.slot(0, "a"):
                pytest.fail("a request past the queue bound got a slot")
        assert str(info.value) == "the server is full: 2 requests running and 0 queued; retry later"
        assert (admission.running, admission.waiting) == (2, 0)
        for gate in gates:
            gate.open()
        await asyncio.gather(*(g.task for g in gates))
        assert_idle(admission)

    run(scenario)
