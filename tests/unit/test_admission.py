"""Admission: running slots and a bounded priority queue behind them, granted by priority then arrival,
shared fairly between clients, and never losing a slot.

Sections: the event loop and requests (the helpers); construction; granting and ordering; the queue bound;
cancellation and failure (a waiter or holder that is cancelled or raises never loses a slot); and client
shares (one client, a token or an address, holds at most --client-share of the running slots and of the
queue, a freed slot goes to the best waiter of a client still under its share whatever the priorities of
those over it, and the gateway's requests, client None, count toward the totals only).

Every test drives one event loop with asyncio.run (no pytest plugin) under a short overall timeout, so a
lost slot shows up as a failure instead of a hang. Waiting requests are tasks that record their name when
they enter their slot; the order of that record is the order in which slots were handed out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import pytest

from pagedserve.plumbing.errors import ResourceExhausted
from services.frontend.admission import Admission, Client

# The event loop and requests ------------------------------------------------------------------------------

T = TypeVar("T")
TIMEOUT_S = 5.0


def run(test: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(test(), TIMEOUT_S)

    return asyncio.run(bounded())


async def settle() -> None:
    """Let every ready task run until it blocks (a handful of loop turns is plenty here)."""
    for _ in range(5):
        await asyncio.sleep(0)  # one turn of this loop, not a wait for time: it runs alike on any machine


class Gate:
    """A request that holds its slot until opened."""

    def __init__(self, admission: Admission, priority: int = 0, client: Client = "a") -> None:
        self.entered = False
        self._open = asyncio.Event()
        self.task = asyncio.create_task(self._hold(admission, priority, client))

    async def _hold(self, admission: Admission, priority: int, client: Client) -> None:
        async with admission.slot(priority, client):
            self.entered = True
            await self._open.wait()

    def open(self) -> None:
        self._open.set()


def enqueue(
    admission: Admission, entered: list[str], name: str, priority: int = 0, client: Client = "a"
) -> asyncio.Task[None]:
    """A request that records `name` in `entered` as soon as it gets its slot, then leaves."""

    async def request() -> None:
        async with admission.slot(priority, client):
            entered.append(name)

    return asyncio.create_task(request(), name=name)


async def enqueue_in_order(
    admission: Admission, entered: list[str], requests: Sequence[tuple[str, int]]
) -> dict[str, asyncio.Task[None]]:
    """Queue (name, priority) requests one after the other, so that their arrival order is the list's."""
    tasks = {}
    for name, priority in requests:
        tasks[name] = enqueue(admission, entered, name, priority)
        await settle()
    return tasks


def assert_idle(admission: Admission) -> None:
    assert (admission.running, admission.waiting) == (0, 0)


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


def test_waiters_of_different_clients_enter_by_priority_then_arrival() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_running=1, max_waiting=4, client_share=1.0)
        entered: list[str] = []
        holder = Gate(admission, client="holder")
        await settle()
        tasks = []
        for name, priority, client in (("a", 1, "a"), ("b", 1, "b"), ("c", 0, "c"), ("a-again", 1, "a")):
            tasks.append(enqueue(admission, entered, name, priority, client))
            await settle()
        holder.open()
        await asyncio.gather(holder.task, *tasks)
        assert_idle(admission)
        return entered

    assert run(scenario) == ["c", "a", "b", "a-again"]


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


# Client shares --------------------------------------------------------------------------------------------


async def open_all(gates: list[Gate]) -> None:
    for gate in gates:
        gate.open()
    await asyncio.gather(*(gate.task for gate in gates))


def test_a_client_over_its_share_waits_while_another_is_admitted_at_once() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=4, max_waiting=8, client_share=0.5)
        theirs = [Gate(admission, priority=0, client="greedy") for _ in range(5)]
        await settle()
        assert [g.entered for g in theirs] == [True, True, False, False, False]  # 2 of 4 slots
        mine = Gate(admission, priority=1000, client="modest")  # the worst priority
        await settle()
        assert mine.entered and (admission.running, admission.waiting) == (3, 3)
        await open_all([*theirs, mine])
        assert_idle(admission)

    run(scenario)


def test_a_freed_slot_passes_over_the_better_priorities_of_a_client_at_its_share() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=2, max_waiting=8, client_share=0.5)
        holders = [Gate(admission, client="greedy"), Gate(admission, client="modest")]
        await settle()
        entered: list[str] = []
        enqueue(admission, entered, "greedy-first", priority=-100, client="greedy")
        await settle()
        modest = enqueue(admission, entered, "modest-later", priority=1000, client="modest")
        await settle()
        assert entered == []
        holders[1].open()  # a slot of modest's frees: greedy is at its share (1 of 2), so modest gets it
        await modest
        assert entered == ["modest-later"]
        holders[0].open()  # greedy's own slot frees: its waiter goes
        await settle()
        assert entered == ["modest-later", "greedy-first"]
        await settle()
        assert_idle(admission)

    run(scenario)


def test_a_clients_queue_share_is_refused_by_name_and_others_still_queue() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=2, max_waiting=4, client_share=0.5)
        gates = [Gate(admission, client="greedy") for _ in range(3)]  # 1 running, 2 queued: its share
        gates += [Gate(admission, client="modest") for _ in range(2)]  # 1 running, 1 queued
        await settle()
        assert (admission.running, admission.waiting) == (2, 3)
        with pytest.raises(
            ResourceExhausted, match=r"this client \(greedy\) has 1 requests running and 2 queued"
        ):
            async with admission.slot(0, "greedy"):
                pass
        late = Gate(admission, client="modest")
        await settle()
        assert admission.waiting == 4
        await open_all([*gates, late])
        assert_idle(admission)

    run(scenario)


def test_the_gateway_has_no_share_but_the_totals() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=4, max_waiting=2, client_share=0.25)
        gates = [Gate(admission, client=None) for _ in range(6)]
        await settle()
        assert (admission.running, admission.waiting) == (4, 2)
        with pytest.raises(ResourceExhausted, match="the server is full"):
            async with admission.slot(0, None):
                pass
        await open_all(gates)
        assert_idle(admission)

    run(scenario)


def test_cancelled_waiters_of_many_clients_leave_every_count_at_zero() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=2, max_waiting=20, client_share=0.5)
        holders = [Gate(admission, client="x"), Gate(admission, client="y")]
        waiters = [Gate(admission, priority=i % 3, client=c) for i, c in enumerate("xyzxyzxyz")]
        await settle()
        for waiter in waiters[::2]:
            waiter.task.cancel()
        await settle()
        await open_all([*holders, *waiters[1::2]])
        await asyncio.gather(*(w.task for w in waiters[::2]), return_exceptions=True)
        assert_idle(admission)
        assert [admission.running_of(client) for client in "xyz"] == [0, 0, 0]

    run(scenario)
