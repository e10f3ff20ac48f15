"""The scheduler under a random workload, with one group of full layers, one of sliding layers, and both
(tests/unit/scheduling.py has the tiny pool and the fake model step): every rule and exact page
accounting hold at every step."""

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
    step,
)

# Groups of layers: one full, one sliding (a window of 5 tokens), and full and sliding ones (a hybrid).
WINDOWS = {"full": (0,), "sliding": (5,), "hybrid": (0, 6)}


@pytest.mark.parametrize("groups", WINDOWS)
@pytest.mark.parametrize("seed", range(40))
def test_a_random_workload_keeps_every_rule_and_exact_page_accounting(seed: int, groups: str) -> None:
    rng = random.Random(seed)
    windows = WINDOWS[groups]
    usable = rng.randint(3, 10) * len(windows)
    kv = make_kv(usable)
    scheduler = make_scheduler(
        kv,
        max_batched_tokens=rng.randint(1, 16),
        max_num_seqs=rng.randint(1, 4),
        prefix_caching=rng.random() < 0.7,
        windows=windows,
    )
    prefixes = [prompt(rng.randint(0, 12), first=100 * i) for i in range(3)]  # shared prompt heads
    seqs: dict[str, Sequence] = {}
    for arrival in range(12):
        # what Engine.submit accepts: room for one output
        length = rng.randint(1, usable // len(windows) * PAGE_SIZE - 1)
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
            assert [len(table) for table in seq.tables] == [-(-seq.num_computed // PAGE_SIZE)] * len(windows)
            assert seq.num_shared <= seq.num_computed // PAGE_SIZE
            for table, dropped, window in zip(seq.tables, seq.dropped, windows, strict=True):
                assert table[:dropped] == [0] * dropped and 0 not in table[dropped:]
                # exactly the pages the next token's window does not see are given back
                assert dropped == (max(0, seq.num_computed - window + 1) if window else 0) // PAGE_SIZE
        for seq in seqs.values():
            if seq.status is not Status.RUNNING:
                assert (seq.tables, seq.num_computed, seq.num_shared) == ([], 0, 0)
        assert held_pages(kv) == sum(len(seq.held_pages) for seq in scheduler.running)
        kv.ledger.check_invariants()
    assert all(seq.status is Status.FINISHED for seq in seqs.values()), "the workload did not finish"
    assert not scheduler.running and scheduler.num_waiting == 0
    assert_settled(kv)
