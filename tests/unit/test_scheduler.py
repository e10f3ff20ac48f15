"""The scheduler, driven step by step without a model (tests/unit/scheduling.py): token budget, chunked
prefill, admission by rank, and a random workload that keeps every rule and exact page accounting.
"""

from __future__ import annotations

import random

import pytest

from services.worker.core.sequence import FinishReason, Sequence, Status
from tests.unit.scheduling import (
    PAGE_SIZE,
    assert_settled,
    held_pages,
    make_kv,
    make_scheduler,
    make_seq,
    prompt,
    run_until_idle,
    step,
)

# Token budget and chunked prefill --------------------------------------------------------------------


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_then_decodes_a_token_a_step() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv, max_batched_tokens=8)
    seq = make_seq("a", prompt(20), max_tokens=3)
    scheduler.add(seq)

    assert step(scheduler).items == [("a", 0, 8, False)]
    assert (seq.num_computed, len(seq.pages), seq.num_tokens) == (8, 2, 20)
    assert step(scheduler).items == [("a", 8, 8, False)]
    assert (seq.num_computed, len(seq.pages), seq.num_tokens) == (16, 4, 20)
    assert step(scheduler).items == [("a", 16, 4, True)]  # only the last chunk samples
    assert (seq.num_computed, len(seq.pages), seq.num_tokens) == (20, 5, 21)
    assert step(scheduler).items == [("a", 20, 1, True)]
    assert (seq.num_computed, len(seq.pages), seq.num_tokens) == (21, 6, 22)
    last = step(scheduler)
    assert (last.items, last.done) == ([("a", 21, 1, True)], ["a"])

    assert seq.output_ids == [1020, 1021, 1022]
    assert (seq.status, seq.finish_reason, seq.pages) == (Status.FINISHED, FinishReason.LENGTH, [])
    assert not scheduler.running and scheduler.num_waiting == 0
    assert_settled(kv)


def test_decodes_and_a_prefill_chunk_share_one_step_budget() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv, max_batched_tokens=8)
    a = make_seq("a", prompt(4), max_tokens=4, arrival=0)
    scheduler.add(a)
    assert step(scheduler).items == [("a", 0, 4, True)]

    scheduler.add(make_seq("b", prompt(10, first=100), max_tokens=2, arrival=1))
    assert step(scheduler).items == [("a", 4, 1, True), ("b", 0, 7, False)]  # 1 + 7 = the budget
    assert step(scheduler).items == [("a", 5, 1, True), ("b", 7, 3, True)]  # 4 tokens: under it
    last = step(scheduler)
    assert (last.items, last.done) == ([("a", 6, 1, True), ("b", 10, 1, True)], ["a", "b"])
    assert_settled(kv)


def test_running_sequences_are_served_before_a_better_ranked_waiting_one() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv, max_batched_tokens=4)
    scheduler.add(make_seq("a", prompt(8), max_tokens=3, priority=5, arrival=0))
    assert step(scheduler).items == [("a", 0, 4, False)]

    scheduler.add(make_seq("vip", prompt(8, first=100), max_tokens=1, priority=0, arrival=1))
    assert step(scheduler).items == [("a", 4, 4, True)]  # the running prefill takes the whole budget
    assert scheduler.num_waiting == 1
    assert step(scheduler).items == [("a", 8, 1, True), ("vip", 0, 3, False)]  # the rest is admitted
    assert [s.items for s in run_until_idle(scheduler)] == [
        [("vip", 3, 4, False)],  # now running, "vip" ranks first and takes the budget
        [("vip", 7, 1, True), ("a", 9, 1, True)],
    ]
    assert_settled(kv)


def test_the_budget_goes_to_the_best_ranked_sequence_first() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv, max_batched_tokens=8)
    scheduler.add(make_seq("low", prompt(12), max_tokens=2, priority=1, arrival=0))
    scheduler.add(make_seq("high", prompt(12, first=100), max_tokens=2, priority=0, arrival=1))

    assert [s.items for s in run_until_idle(scheduler)] == [
        [("high", 0, 8, False)],  # the budget is spent: "low" is not admitted
        [("high", 8, 4, True), ("low", 0, 4, False)],
        [("high", 12, 1, True), ("low", 4, 7, False)],
        [("low", 11, 1, True)],
        [("low", 12, 1, True)],
    ]
    assert_settled(kv)


def test_max_num_seqs_caps_the_running_sequences() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv, max_num_seqs=2)
    for arrival, (key, max_tokens) in enumerate([("a", 1), ("b", 2), ("c", 2)]):
        scheduler.add(make_seq(key, prompt(4, first=10 * arrival), max_tokens=max_tokens, arrival=arrival))

    first = step(scheduler)
    assert (first.items, first.done) == ([("a", 0, 4, True), ("b", 0, 4, True)], ["a"])
    assert scheduler.num_waiting == 1  # "c" waited although the budget and the pool had room
    assert step(scheduler).items == [("b", 4, 1, True), ("c", 0, 4, True)]  # "a" left a slot
    assert step(scheduler).items == [("c", 4, 1, True)]
    assert_settled(kv)


# Admission by rank -----------------------------------------------------------------------------------


def test_waiting_sequences_are_admitted_by_priority_then_arrival() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv, max_num_seqs=1)
    for key, priority, arrival in [("p2", 2, 0), ("p0", 0, 1), ("p1-late", 1, 3), ("p1-early", 1, 2)]:
        scheduler.add(
            make_seq(key, prompt(4, first=10 * arrival), max_tokens=1, priority=priority, arrival=arrival)
        )

    order = [s.items for s in run_until_idle(scheduler)]
    assert order == [[(key, 0, 4, True)] for key in ["p0", "p1-early", "p1-late", "p2"]]
    assert_settled(kv)


# A random workload -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_a_random_workload_keeps_every_rule_and_exact_page_accounting(seed: int) -> None:
    rng = random.Random(seed)
    usable = rng.randint(3, 10)
    kv = make_kv(usable)
    scheduler = make_scheduler(
        kv,
        max_batched_tokens=rng.randint(1, 16),
        max_num_seqs=rng.randint(1, 4),
        prefix_caching=rng.random() < 0.7,
    )
    prefixes = [prompt(rng.randint(0, 12), first=100 * i) for i in range(3)]  # shared prompt heads
    seqs: dict[str, Sequence] = {}
    for arrival in range(12):
        length = rng.randint(1, usable * PAGE_SIZE - 1)  # what Engine.submit accepts: room for one output
        head = rng.choice(prefixes)[:length]
        tokens = head + [rng.randint(0, 99) for _ in range(length - len(head))]
        seq = make_seq(
            str(arrival), tokens, max_tokens=rng.randint(1, 8), priority=rng.randint(0, 2), arrival=arrival
        )
        seqs[str(arrival)] = seq
        scheduler.add(seq)

    for _ in range(500):
        live = [seq for seq in seqs.values() if seq.status is not Status.FINISHED]
        if not live:
            break
        if rng.random() < 0.03:
            scheduler.finish(rng.choice(live), FinishReason.ABORT)
        running_before = list(scheduler.running)
        result = step(scheduler)

        scheduled = [seqs[key] for key, *_ in result.items]
        assert sum(count for *_, count, _ in result.items) <= scheduler.max_batched_tokens
        assert len(set(map(id, scheduled))) == len(scheduled)
        assert len(scheduler.running) <= scheduler.max_num_seqs
        for seq in running_before:
            if seq.status is Status.WAITING and seq not in scheduled:  # preempted: nothing worse ran
                assert all(other.rank < seq.rank for other in scheduled), (seq.key, result.items)
        for seq in scheduler.running:
            assert len(seq.pages) == -(-seq.num_computed // PAGE_SIZE)
            assert seq.num_shared <= seq.num_computed // PAGE_SIZE
        for seq in seqs.values():
            if seq.status is not Status.RUNNING:
                assert (seq.pages, seq.num_computed, seq.num_shared) == ([], 0, 0)
        assert held_pages(kv) == sum(len(seq.pages) for seq in scheduler.running)
        kv.ledger.check_invariants()
    assert all(seq.status is Status.FINISHED for seq in seqs.values()), "the workload did not finish"
    assert not scheduler.running and scheduler.num_waiting == 0
    assert_settled(kv)
