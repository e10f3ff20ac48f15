"""The scheduler's preemption by recompute, and sequences the pool cannot hold, with exact page
accounting (tests/unit/scheduling.py drives it step by step without a model).
"""

from __future__ import annotations

from services.worker.core.sequence import FinishReason, Status
from tests.unit.scheduling import (
    assert_settled,
    held_pages,
    make_kv,
    make_scheduler,
    make_seq,
    prompt,
    run_until_idle,
    step,
)

# Preemption by recompute -----------------------------------------------------------------------------


def test_the_worst_ranked_running_sequence_is_preempted_and_recomputed_later() -> None:
    kv = make_kv(5)
    scheduler = make_scheduler(kv, prefix_caching=False)
    best = make_seq("best", prompt(4), max_tokens=3, priority=0, arrival=2)  # latest, but best priority
    mid = make_seq("mid", prompt(5, first=10), max_tokens=3, priority=1, arrival=0)
    worst = make_seq("worst", prompt(5, first=20), max_tokens=3, priority=1, arrival=1)  # ties, arrived later
    for seq in (best, mid, worst):
        scheduler.add(seq)

    assert step(scheduler).items == [("best", 0, 4, True), ("mid", 0, 5, True), ("worst", 0, 5, True)]
    assert [len(seq.pages) for seq in (best, mid, worst)] == [1, 2, 2]
    assert (held_pages(kv), kv.stats().free_pages) == (5, 0)

    # "best" needs a second page and the pool is full: of "mid" and "worst", "worst" goes.
    assert step(scheduler).items == [("best", 4, 1, True), ("mid", 5, 1, True)]
    assert (scheduler.preemptions, worst.preemptions, best.preemptions, mid.preemptions) == (1, 1, 0, 0)
    assert (worst.status, worst.num_computed, worst.pages) == (Status.WAITING, 0, [])
    assert worst.tokens == [20, 21, 22, 23, 24, 1005]  # its sampled token stays, to be recomputed
    assert scheduler.running == [best, mid] and scheduler.num_waiting == 1
    assert [len(seq.pages) for seq in (best, mid)] == [2, 2]
    assert (held_pages(kv), kv.usage().idle_pages) == (4, 1)  # one of its pages went to "best"

    third = step(scheduler)  # "worst" needs two pages, one is free: it waits until the others finish
    assert (third.items, third.done) == ([("best", 5, 1, True), ("mid", 6, 1, True)], ["best", "mid"])
    assert [s.items for s in run_until_idle(scheduler)] == [
        [("worst", 0, 6, True)],  # prompt and output recomputed from scratch
        [("worst", 6, 1, True)],
    ]
    assert worst.output_ids == [1005, 1006, 1007]
    assert (worst.finish_reason, scheduler.preemptions) == (FinishReason.LENGTH, 1)
    assert_settled(kv)


def test_a_sequence_preempts_itself_rather_than_a_better_ranked_one() -> None:
    kv = make_kv(3)
    scheduler = make_scheduler(kv, prefix_caching=False)
    better = make_seq("better", prompt(4), max_tokens=3, priority=0, arrival=1)
    worse = make_seq("worse", prompt(4, first=10), max_tokens=2, priority=1, arrival=0)  # arrived first
    scheduler.add(worse)
    scheduler.add(better)
    assert step(scheduler).items == [("better", 0, 4, True), ("worse", 0, 4, True)]
    first_page = better.pages[0]

    # "better" takes the last page; "worse" needs one too, and as no worse sequence runs, it goes itself.
    assert step(scheduler).items == [("better", 4, 1, True)]
    assert (better.status, better.num_computed, len(better.pages)) == (Status.RUNNING, 5, 2)
    assert better.pages[0] == first_page
    assert (worse.status, worse.pages, worse.num_computed) == (Status.WAITING, [], 0)
    assert (better.preemptions, worse.preemptions, scheduler.preemptions) == (0, 1, 1)
    assert [s.items for s in run_until_idle(scheduler)] == [
        [("better", 5, 1, True)],  # one page is free, "worse" needs two
        [("worse", 0, 5, True)],
    ]
    assert_settled(kv)


def test_a_better_ranked_waiting_sequence_waits_rather_than_preempting() -> None:
    kv = make_kv(2)
    scheduler = make_scheduler(kv)
    scheduler.add(make_seq("low", prompt(7), max_tokens=2, priority=9, arrival=0))
    assert step(scheduler).items == [("low", 0, 7, True)]  # both pages

    scheduler.add(make_seq("high", prompt(4, first=100), max_tokens=1, priority=0, arrival=1))
    second = step(scheduler)
    assert (second.items, second.done, scheduler.preemptions) == ([("low", 7, 1, True)], ["low"], 0)
    assert [s.items for s in run_until_idle(scheduler)] == [[("high", 0, 4, True)]]
    assert_settled(kv)


def test_a_preempted_sequence_recomputes_only_what_is_not_cached() -> None:
    kv = make_kv(4)
    scheduler = make_scheduler(kv)
    short = make_seq("short", prompt(4), max_tokens=2, priority=0, arrival=0)
    long = make_seq("long", prompt(8, first=100), max_tokens=2, priority=1, arrival=1)
    scheduler.add(short)
    scheduler.add(long)
    assert step(scheduler).items == [("short", 0, 4, True), ("long", 0, 8, True)]
    assert (short.num_shared, long.num_shared) == (1, 2)  # their full pages are published

    # "short" takes the last free page; "long" needs a third and goes, its published pages stay cached.
    second = step(scheduler)
    assert (second.items, second.done) == ([("short", 4, 1, True)], ["short"])
    assert (long.status, long.pages, long.preemptions) == (Status.WAITING, [], 1)
    counts = kv.stats()
    assert (counts.cached_pages, counts.evictable_pages) == (3, 3)  # "long"'s two and "short"'s one

    assert [s.items for s in run_until_idle(scheduler)] == [
        [("long", 8, 1, True)],  # its two prompt pages come from the cache: only the sampled token is left
    ]
    assert long.cached_prompt_tokens == 0  # what the first admission found, not the readmission
    assert kv.stats().prefix_hit_pages == 4  # 2 when its readmission failed in step 2, 2 in step 3
    assert_settled(kv)


# Sequences the pool cannot hold ----------------------------------------------------------------------


def test_a_prompt_larger_than_the_pool_is_finished_with_length() -> None:
    kv = make_kv(4)  # 16 tokens
    scheduler = make_scheduler(kv, max_batched_tokens=8)
    seq = make_seq("big", prompt(20), max_tokens=4)
    scheduler.add(seq)
    assert step(scheduler).items == [("big", 0, 8, False)]
    assert step(scheduler).items == [("big", 8, 8, False)]

    plan = scheduler.schedule()  # the last chunk needs a fifth page: alone, it cannot have one
    assert (plan.items, plan.finished) == ([], [seq])
    assert (seq.status, seq.finish_reason, seq.pages, seq.output_ids) == (
        Status.FINISHED,
        FinishReason.LENGTH,
        [],
        [],
    )
    assert not scheduler.running and scheduler.num_waiting == 0 and scheduler.preemptions == 0
    assert_settled(kv)


def test_a_sequence_that_outgrows_the_pool_while_decoding_is_finished_with_length() -> None:
    kv = make_kv(2)
    scheduler = make_scheduler(kv)
    seq = make_seq("grows", prompt(7), max_tokens=10)
    scheduler.add(seq)
    steps = run_until_idle(scheduler)
    assert [(s.items, s.dropped) for s in steps] == [
        ([("grows", 0, 7, True)], []),
        ([("grows", 7, 1, True)], []),
        ([], ["grows"]),  # the ninth token needs a third page
    ]
    assert (seq.finish_reason, seq.output_ids) == (FinishReason.LENGTH, [1007, 1008])
    assert_settled(kv)
