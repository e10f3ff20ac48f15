"""How sequences leave the scheduler: finish() on a running or waiting sequence, and the stop rules
postprocess applies (tests/unit/scheduling.py drives it step by step without a model).
"""

from __future__ import annotations

import pytest

from services.common.sampling import SamplingOptions
from services.worker.core.sampler import Samples
from services.worker.core.scheduler import Scheduler
from services.worker.core.sequence import FinishReason, Sequence, Status
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

# finish() --------------------------------------------------------------------------------------------


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
    seq = Sequence(key="r", tokens=prompt(5), prompt_len=5, options=options, priority=0, arrival=0)
    scheduler.add(seq)
    plan = scheduler.schedule()
    (output,) = scheduler.postprocess(scheduler.commit(plan.items, [seq]), Samples([token], [None]))
    assert (output.key, output.token_ids, output.finish_reason, output.prompt_tokens) == (
        "r",
        [token],
        reason,
        5,
    )
    assert (seq.finish_reason, "r" in scheduler.requests) == (reason, reason is None)
    assert held_pages(kv) == (0 if reason else 2)


# A launched step's tokens --------------------------------------------------------------------------------


def test_a_dead_end_drops_its_placeholder_and_counts_no_token() -> None:
    kv = make_kv(8)
    scheduler = make_scheduler(kv)
    seq = Sequence("r", prompt(5), 5, SamplingOptions(max_tokens=5, min_tokens=1), priority=0, arrival=0)
    scheduler.add(seq)
    launch = scheduler.commit(scheduler.schedule().items, [seq])
    (output,) = scheduler.postprocess(launch, Samples([999], [None], dead_ends=frozenset({0})))
    assert output.error is not None and "after 0 tokens: min_tokens (1)" in output.error.message
    assert (seq.tokens, seq.in_flight, output.token_ids) == (prompt(5), 0, [])
    assert_settled(kv)


def test_a_sequence_the_pool_cannot_hold_alone_gets_its_token_in_flight_first() -> None:
    kv = make_kv(1)  # one page of 4 tokens
    scheduler = make_scheduler(kv)
    seq = make_seq("r", prompt(3), max_tokens=5)
    scheduler.add(seq)
    first = scheduler.commit(scheduler.schedule().items, [seq])  # 3 tokens computed; the 4th on its way
    second = scheduler.commit(scheduler.schedule().items, [seq])  # the 4th token's KV fills the page
    assert seq.in_flight == 2
    plan = scheduler.schedule()  # a 5th token needs a second page, which the pool does not have
    assert (plan.items, plan.finished) == ([], [])  # not dropped while its token is in flight
    assert scheduler.postprocess(first, Samples([1003], [None]))[0].token_ids == [1003]
    assert scheduler.postprocess(second, Samples([1004], [None]))[0].token_ids == [1004]
    plan = scheduler.schedule()
    assert plan.finished == [seq] and seq.finish_reason is FinishReason.LENGTH
    assert seq.tokens == [*prompt(3), 1003, 1004]
    assert_settled(kv)
