"""The scheduler, driven step by step without a model (tests/unit/scheduling.py has the tiny pool and the
fake model step).

Sections: token budget and chunked prefill; admission by rank; prefix caching on admission (a hybrid
model's groups too); preemption by recompute; sequences the pool cannot hold; finish() and the stop rules
postprocess applies; a grammar's compile (COMPILING); and a launched step's tokens.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from pagedserve.plumbing.errors import InvalidArgument
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.common.structured import Constraint
from services.worker.core.sampler import Samples
from services.worker.core.scheduler import Scheduler
from services.worker.core.sequence import FinishReason, Sequence, Status
from tests.unit.scheduling import (
    FAKE_TOKEN,
    assert_settled,
    held_pages,
    launch,
    make_kv,
    make_scheduler,
    make_seq,
    prompt,
    run_until_idle,
    step,
)

# Token budget and chunked prefill ---------------------------------------------------------------------------


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


# Admission by rank ------------------------------------------------------------------------------------------


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


# Prefix caching on admission --------------------------------------------------------------------------------


def test_admission_reuses_published_prefix_pages() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv)
    first = make_seq("first", prompt(10), max_tokens=2, arrival=0)  # two full pages and two tokens
    scheduler.add(first)
    assert step(scheduler).items == [("first", 0, 10, True)]
    first_pages = first.pages[:2]
    scheduler.finish(first, FinishReason.STOP)  # its published pages stay cached
    assert first.cached_prompt_tokens == 0
    assert kv.stats().cached_pages == 2

    second = make_seq("second", [*prompt(10), 50, 51, 52], max_tokens=2, arrival=1)
    scheduler.add(second)
    assert step(scheduler).items == [("second", 8, 5, True)]  # the third page differs: 2 pages found
    assert (second.cached_prompt_tokens, second.num_computed, len(second.pages)) == (8, 13, 4)
    assert second.pages[:2] == first_pages  # the very pages "first" published
    assert second.num_shared == 3  # the two found, and its own third page once computed
    counts = kv.stats()
    assert (counts.prefix_lookups, counts.prefix_hits, counts.prefix_hit_pages) == (2, 1, 2)
    assert [s.items for s in run_until_idle(scheduler)] == [[("second", 13, 1, True)]]
    assert_settled(kv)


def test_a_prompt_of_whole_pages_leaves_its_last_page_to_compute() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv)
    scheduler.add(make_seq("first", prompt(12), max_tokens=1, arrival=0))
    run_until_idle(scheduler)
    assert kv.stats().cached_pages == 3

    again = make_seq("again", prompt(12), max_tokens=1, arrival=1)  # every page is cached
    scheduler.add(again)
    assert step(scheduler).items == [("again", 8, 4, True)]  # the last page is computed, to sample from
    assert again.cached_prompt_tokens == 8

    page = make_seq("page", prompt(4), max_tokens=1, arrival=2)  # one page: nothing may match
    scheduler.add(page)
    lookups = kv.stats().prefix_lookups
    assert step(scheduler).items == [("page", 0, 4, True)]
    assert (page.cached_prompt_tokens, kv.stats().prefix_lookups) == (0, lookups)  # not even looked up
    assert_settled(kv)


def test_without_prefix_caching_nothing_is_published_or_matched() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv, prefix_caching=False)
    scheduler.add(make_seq("first", prompt(10), max_tokens=1, arrival=0))
    run_until_idle(scheduler)
    second = make_seq("second", prompt(10), max_tokens=1, arrival=1)
    scheduler.add(second)

    assert step(scheduler).items == [("second", 0, 10, True)]
    assert (second.cached_prompt_tokens, second.num_shared) == (0, 0)
    counts = kv.stats()
    assert (counts.prefix_lookups, counts.cached_pages, counts.shared_pages) == (0, 0, 0)
    assert_settled(kv)


def test_a_sequence_that_cannot_be_admitted_drops_its_prefix_references() -> None:
    kv = make_kv(4)
    scheduler = make_scheduler(kv)
    scheduler.add(make_seq("seed", prompt(8), max_tokens=1, arrival=0))
    run_until_idle(scheduler)  # two cached pages, evictable
    hog = make_seq("hog", prompt(7, first=100), max_tokens=2, arrival=1)
    scheduler.add(hog)
    assert step(scheduler).items == [("hog", 0, 7, True)]  # the two free pages: "seed"'s stay cached

    reuse = make_seq("reuse", [*prompt(8), 60, 61, 62, 63, 64], max_tokens=1, arrival=2)
    scheduler.add(reuse)
    blocked = step(scheduler)  # "reuse" finds the 2 cached pages but needs 2 more: none is left
    assert (blocked.items, blocked.done) == ([("hog", 7, 1, True)], ["hog"])
    assert (reuse.status, reuse.pages, reuse.num_computed) == (Status.WAITING, [], 0)
    assert held_pages(kv) == 0  # it does not sit on the cached pages while it waits
    assert kv.stats().evictable_pages == 4  # "seed"'s two and "hog"'s two

    assert [s.items for s in run_until_idle(scheduler)] == [[("reuse", 8, 5, True)]]
    assert reuse.cached_prompt_tokens == 8
    assert_settled(kv)


def test_a_hybrid_model_keeps_a_table_per_group_and_finds_only_its_windows_pages() -> None:
    """Layers in two groups, full (0) and sliding over 6 tokens (1): each sequence has a block table per
    group, pages taken in pairs; the sliding table gives back its pages out of the window as the sequence
    runs (the null page in their place), and a later request finds its prefix with the full group's pages from
    the first one and the sliding group's from its window on, whether or not the earlier ones are still in
    the cache."""
    kv = make_kv(40)
    scheduler = Scheduler(kv, max_batched_tokens=64, max_num_seqs=8, windows=(0, 6))
    first = make_seq("first", prompt(21), max_tokens=2)
    scheduler.add(first)
    plan = scheduler.schedule()  # the prompt: 6 pages for each group
    page_3 = first.tables[1][3]
    scheduler.postprocess(launch(scheduler, plan.items), Samples([FAKE_TOKEN], [None]))
    # The next token's window is positions 16..21: pages 0..3 of the sliding group are back.
    assert [len(table) for table in first.tables] == [6, 6] and first.dropped == [0, 4]
    assert first.tables[1][:4] == [0] * 4 and first.held_pages == first.tables[0] + first.tables[1][4:]
    assert held_pages(kv) == 8
    first_pages = [table[:5] for table in first.tables]  # the full ones, published: the sliding group's too
    run_until_idle(scheduler)
    assert held_pages(kv) == 0

    second = make_seq("second", prompt(21) + prompt(6, first=500), max_tokens=1)
    scheduler.add(second)
    plan = scheduler.schedule()
    # Found: the 5 full pages of the shared 21 tokens; of the sliding group's, only pages 3 and 4, which the
    # window from position 20 on sees (20 - 6 + 1 = 15 is on page 3), though pages 0..2 are still cached.
    assert second.cached_prompt_tokens == 20 and second.dropped == [0, 3]
    assert second.tables[0][:5] == first_pages[0] and second.tables[1][:4] == [0] * 3 + [page_3]
    assert second.tables[1][4] == first_pages[1][4]
    assert [len(table) for table in second.tables] == [7, 7]  # and 2 new pages each, for tokens 20..26
    assert held_pages(kv) == 7 + 4
    scheduler.postprocess(launch(scheduler, plan.items), Samples([FAKE_TOKEN], [None]))
    run_until_idle(scheduler)
    assert_settled(kv)


# Preemption by recompute ------------------------------------------------------------------------------------


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


# Sequences the pool cannot hold -----------------------------------------------------------------------------


def test_a_prompt_larger_than_the_pool_is_finished_with_length() -> None:
    kv = make_kv(4)  # 16 tokens
    scheduler = make_scheduler(kv, max_batched_tokens=8)
    seq = make_seq("big", prompt(20), max_tokens=4)
    scheduler.add(seq)
    assert step(scheduler).items == [("big", 0, 8, False)]
    assert step(scheduler).items == [("big", 8, 8, False)]

    plan = scheduler.schedule()  # the last chunk needs a fifth page: alone, it cannot have one
    assert (plan.items, [output.key for output in plan.ended]) == ([], [seq.key])
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


# finish() and the stop rules --------------------------------------------------------------------------------


def test_finishing_a_running_sequence_frees_its_pages_at_once() -> None:
    kv = make_kv(4)
    scheduler = make_scheduler(kv)
    a = make_seq("a", prompt(6), max_tokens=5, arrival=0)
    b = make_seq("b", prompt(6, first=100), max_tokens=5, arrival=1)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler).items == [("a", 0, 6, True), ("b", 0, 6, True)]
    assert held_pages(kv) == 4 and kv.stats().free_pages == 0

    scheduler.finish(a, FinishReason.ABORT)
    assert (a.status, a.finish_reason, a.pages, a.num_computed) == (
        Status.FINISHED,
        FinishReason.ABORT,
        [],
        0,
    )
    assert scheduler.running == [b]
    assert held_pages(kv) == 2  # "a"'s published page is cached, its other page is free again
    assert kv.stats().evictable_pages == 1

    scheduler.finish(b, FinishReason.STOP)
    assert not scheduler.running and held_pages(kv) == 0
    assert step(scheduler).items == []
    assert_settled(kv)


def test_finishing_a_waiting_sequence_removes_it_from_the_queue() -> None:
    kv = make_kv(3)
    scheduler = make_scheduler(kv, prefix_caching=False)
    better = make_seq("better", prompt(4), max_tokens=2, priority=0, arrival=0)
    worse = make_seq("worse", prompt(4, first=10), max_tokens=2, priority=1, arrival=1)
    never = make_seq("never", prompt(4, first=20), max_tokens=2, priority=2, arrival=2)
    for seq in (better, worse, never):
        scheduler.add(seq)
    assert step(scheduler).items == [("better", 0, 4, True), ("worse", 0, 4, True), ("never", 0, 4, True)]
    # "better" and "worse" each need a second page: "never" is preempted for "better", "worse" goes itself.
    second = step(scheduler)
    assert (second.items, second.done) == ([("better", 4, 1, True)], ["better"])
    assert (never.status, worse.status, scheduler.num_waiting) == (Status.WAITING, Status.WAITING, 2)

    scheduler.finish(never, FinishReason.ABORT)  # a preempted sequence, waiting to be recomputed
    assert (never.status, never.finish_reason, never.pages, scheduler.num_waiting) == (
        Status.FINISHED,
        FinishReason.ABORT,
        [],
        1,
    )
    assert [s.items for s in run_until_idle(scheduler)] == [[("worse", 0, 5, True)]]
    assert scheduler.preemptions == 2
    assert_settled(kv)


@pytest.mark.parametrize(
    ("options", "token", "max_model_len", "reason"),
    [
        (SamplingOptions(max_tokens=5), 2, 100, FinishReason.STOP),  # EOS
        (SamplingOptions(max_tokens=5, ignore_eos=True), 2, 100, None),
        (SamplingOptions(max_tokens=5, ignore_eos=True, stop_token_ids=(2,)), 2, 100, FinishReason.STOP),
        (SamplingOptions(max_tokens=5, stop_token_ids=(7,)), 7, 100, FinishReason.STOP),
        (SamplingOptions(max_tokens=1), 9, 100, FinishReason.LENGTH),
        (SamplingOptions(max_tokens=5), 9, 6, FinishReason.LENGTH),  # the context is full
        (SamplingOptions(max_tokens=5), 9, 100, None),
    ],
)
def test_postprocess_applies_the_stop_rules_and_frees_a_finished_sequence(
    options: SamplingOptions, token: int, max_model_len: int, reason: FinishReason | None
) -> None:
    kv = make_kv(8)
    scheduler = Scheduler(
        kv, max_batched_tokens=64, max_num_seqs=8, eos_token_ids=(2,), max_model_len=max_model_len
    )
    seq = Sequence("r", EngineRequest(tuple(prompt(5)), options), arrival=0)
    scheduler.add(seq)
    plan = scheduler.schedule()
    (output,) = scheduler.postprocess(launch(scheduler, plan.items), Samples([token], [None]))
    assert (output.key, output.token_ids, output.finish_reason, output.prompt_tokens) == (
        "r",
        [token],
        reason,
        5,
    )
    assert (seq.finish_reason, "r" in scheduler.requests) == (reason, reason is None)
    assert held_pages(kv) == (0 if reason else 2)


# A grammar's compile: the sequence waits, as COMPILING ------------------------------------------------------


class AcceptsAll:
    """A compiled grammar that allows every token and never ends: the compile's state is what is tested."""

    terminated = False

    def accept(self, token_id: int) -> bool:
        return True


def compiling_seq(key: str, compiled: Future) -> Sequence:
    structured = Constraint("regex", "[ab]+")
    request = EngineRequest(tuple(prompt(5)), SamplingOptions(max_tokens=2, structured=structured))
    return Sequence(key, request, arrival=0, grammar=compiled)


def test_a_compiling_sequence_waits_without_pages_then_runs_once_its_grammar_is_ready() -> None:
    kv = make_kv(8)
    scheduler = make_scheduler(kv)
    compiled: Future = Future()
    seq = compiling_seq("r", compiled)
    scheduler.add(seq)
    assert (seq.status, scheduler.num_waiting, scheduler.has_work()) == (Status.COMPILING, 1, False)
    plan = scheduler.schedule()
    assert (plan.items, plan.ended, held_pages(kv)) == ([], [], 0)
    compiled.set_result(AcceptsAll())
    assert scheduler.has_work()
    assert [(item.seq.key, item.count) for item in scheduler.schedule().items] == [("r", 5)]
    assert seq.status is Status.RUNNING and seq.grammar is not None and seq.compiling is None


def test_a_grammar_that_fails_to_compile_ends_its_sequence_with_the_refusal() -> None:
    kv = make_kv(8)
    scheduler = make_scheduler(kv)
    compiled: Future = Future()
    scheduler.add(compiling_seq("r", compiled))
    compiled.set_exception(InvalidArgument("sampling.structured.regex does not compile: bad"))
    plan = scheduler.schedule()
    (output,) = plan.ended
    assert (output.key, output.finish_reason, str(output.error)) == (
        "r",
        FinishReason.ABORT,
        "sampling.structured.regex does not compile: bad",
    )
    assert (plan.items, scheduler.requests, scheduler.num_waiting) == ([], {}, 0)
    assert_settled(kv)


def test_a_sequence_aborted_while_compiling_leaves_nothing_behind() -> None:
    kv = make_kv(8)
    scheduler = make_scheduler(kv)
    compiled: Future = Future()
    compiled.set_running_or_notify_cancel()  # compiling already
    seq = compiling_seq("r", compiled)
    scheduler.add(seq)
    scheduler.finish(seq, FinishReason.ABORT)
    compiled.set_result(AcceptsAll())  # the compile ends later: nothing waits for it
    assert (scheduler.schedule().items, scheduler.requests, scheduler.num_waiting) == ([], {}, 0)
    assert seq.status is Status.FINISHED and seq.grammar is None
    assert_settled(kv)


def test_an_aborted_sequences_compile_that_has_not_started_is_called_off() -> None:
    """The grammar compiler has one thread, and a schema may take it a minute (2300 optional properties took
    80 s): compiles queued for clients that gave up would each hold up every structured request in turn."""
    scheduler = make_scheduler(make_kv(8))
    queued: Future = Future()
    running: Future = Future()
    running.set_running_or_notify_cancel()
    for key, compiled in (("queued", queued), ("running", running)):
        seq = compiling_seq(key, compiled)
        scheduler.add(seq)
        scheduler.finish(seq, FinishReason.ABORT)
    assert queued.cancelled() and not running.cancelled()


# A launched step's tokens -----------------------------------------------------------------------------------


def test_a_dead_end_drops_its_placeholder_and_counts_no_token() -> None:
    kv = make_kv(8)
    scheduler = make_scheduler(kv)
    seq = Sequence("r", EngineRequest(tuple(prompt(5)), SamplingOptions(max_tokens=5, min_tokens=1)), 0)
    scheduler.add(seq)
    step = launch(scheduler, scheduler.schedule().items)
    (output,) = scheduler.postprocess(step, Samples([999], [None], dead_ends=frozenset({0})))
    assert output.error is not None and "after 0 tokens: min_tokens (1)" in output.error.message
    assert (seq.tokens, seq.in_flight, output.token_ids) == (prompt(5), 0, [])
    assert_settled(kv)


def test_a_sequence_the_pool_cannot_hold_alone_gets_its_token_in_flight_first() -> None:
    kv = make_kv(1)  # one page of 4 tokens
    scheduler = make_scheduler(kv)
    seq = make_seq("r", prompt(3), max_tokens=5)
    scheduler.add(seq)
    first = launch(scheduler, scheduler.schedule().items)  # 3 tokens computed; the 4th on its way
    second = launch(scheduler, scheduler.schedule().items)  # the 4th token's KV fills the page
    assert seq.in_flight == 2
    plan = scheduler.schedule()  # a 5th token needs a second page, which the pool does not have
    assert (plan.items, plan.ended) == ([], [])  # not dropped while its token is in flight
    assert scheduler.postprocess(first, Samples([1003], [None]))[0].token_ids == [1003]
    assert scheduler.postprocess(second, Samples([1004], [None]))[0].token_ids == [1004]
    plan = scheduler.schedule()
    assert [output.key for output in plan.ended] == [seq.key] and seq.finish_reason is FinishReason.LENGTH
    assert seq.tokens == [*prompt(3), 1003, 1004]
    assert_settled(kv)
