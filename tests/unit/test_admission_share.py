"""Each client's share of admission: one client (a token or an address) holds at most --client-share of
the running slots and of the queue, a freed slot goes to the best waiter of a client still under its share
whatever the priorities of those over it, and the gateway's requests (client None) count toward the totals
only."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.plumbing.errors import ResourceExhausted
from services.frontend.admission import Admission
from tests.unit.admitting import Gate, assert_idle, enqueue, run, settle


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
