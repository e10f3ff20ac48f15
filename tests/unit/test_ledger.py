"""The page ledger: the free list, leases, shared pages, lookups, eviction and refills, with exact page ids
and counts; and bad input, which it refuses whole, the counts not moving.

The `ledger` fixture (tests/unit/conftest.py) is a pool of the null page and pages 1..8; the page keys
(tests/unit/ledgers.py, shared with the prefix event and publisher tests) are four chained keys. Sections:
grants, releases and leases; shared pages and lookups; eviction; refills and reclaim; bad input.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from memory_daemon.ledger import PageLedger
from memory_daemon.refill import RefillSettings
from pagedserve.plumbing.errors import FailedPrecondition, Internal, InvalidArgument, PermissionDenied
from tests.unit.ledgers import KEYS

# Grants, releases and leases --------------------------------------------------------------------------------


def test_grant_hands_out_pages_in_order_and_never_the_null_page(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    assert ledger.grant(worker, 3) == [1, 2, 3]
    assert ledger.grant(worker, 5) == [4, 5, 6, 7, 8]
    assert ledger.grant(worker, 1) == []  # nothing left, none needed
    assert ledger.grant(worker, 1, need=1) is None  # "no room now" is None, not an error
    assert worker.pages == set(range(1, 9))
    counts = ledger.counts()
    assert (counts.total_pages, counts.free_pages, counts.leased_pages) == (8, 0, 8)
    ledger.check_invariants()


def test_grant_gives_fewer_when_short_but_never_less_than_need(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 6)
    assert ledger.grant(worker, 5, need=3) is None
    assert ledger.grant(worker, 5, need=2) == [7, 8]


def test_released_pages_are_reused_last_in_first_out(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 4)
    ledger.update(worker, release=[2, 4])
    assert ledger.free_pages == 6
    assert ledger.grant(worker, 3) == [4, 2, 5]
    ledger.check_invariants()


def test_close_lease_returns_every_page(ledger: PageLedger) -> None:
    a, b = ledger.open_lease("a", "m"), ledger.open_lease("b", "m")
    ledger.grant(a, 3)
    ledger.grant(b, 2)
    assert ledger.close_lease(a) == (3, 0)
    counts = ledger.counts()
    assert (counts.free_pages, counts.leased_pages) == (6, 2)
    assert [w.name for w in counts.workers] == ["b"]
    ledger.check_invariants()


# Shared pages and lookups -----------------------------------------------------------------------------------


def test_publish_makes_pages_shared_and_unref_leaves_them_cached(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 3)
    assert ledger.update(worker, publish=[(KEYS[0], 1), (KEYS[1], 2)]) == 2
    counts = ledger.counts()
    assert (counts.leased_pages, counts.shared_pages, counts.cached_pages, counts.evictable_pages) == (
        1,
        2,
        2,
        0,
    )
    assert worker.pages == {3} and dict(worker.refs) == {1: 1, 2: 1}
    ledger.update(worker, unref=[1, 2], release=[3])
    counts = ledger.counts()
    assert (counts.free_pages, counts.shared_pages, counts.cached_pages, counts.evictable_pages) == (
        6,
        2,
        2,
        2,
    )
    assert counts.settled
    ledger.check_invariants()


def test_publish_of_a_key_already_cached_frees_the_duplicate_on_unref(ledger: PageLedger) -> None:
    a, b = ledger.open_lease("a", "m"), ledger.open_lease("b", "m")
    ledger.grant(a, 1)
    ledger.grant(b, 1)
    assert ledger.update(a, publish=[(KEYS[0], 1)]) == 1
    assert ledger.update(b, publish=[(KEYS[0], 2)]) == 0  # page 2 is shared but not indexed
    ledger.update(b, unref=[2])
    assert ledger.free_pages == 7  # page 2 went straight back
    assert ledger.lookup(b, KEYS[:1]) == [1]
    ledger.check_invariants()


def test_lookup_returns_the_longest_matched_run_and_takes_references(ledger: PageLedger) -> None:
    writer, reader = ledger.open_lease("writer", "m"), ledger.open_lease("reader", "m")
    ledger.grant(writer, 3)
    ledger.update(writer, publish=[(KEYS[0], 1), (KEYS[1], 2), (KEYS[3], 3)])  # KEYS[2] is missing
    assert ledger.lookup(reader, KEYS) == [1, 2]  # stops at the first miss
    assert dict(reader.refs) == {1: 1, 2: 1}
    assert ledger.lookup(reader, [b"other-chain-key-"]) == []
    counts = ledger.counts()
    assert (
        counts.prefix_lookups,
        counts.prefix_hits,
        counts.prefix_queried_pages,
        counts.prefix_hit_pages,
    ) == (
        2,
        1,
        5,
        2,
    )
    ledger.check_invariants()


def test_the_index_is_namespaced_by_model(ledger: PageLedger) -> None:
    llama, qwen = ledger.open_lease("a", "llama"), ledger.open_lease("b", "qwen")
    ledger.grant(llama, 1)
    ledger.update(llama, publish=[(KEYS[0], 1)])
    assert ledger.lookup(qwen, KEYS[:1]) == []
    assert ledger.lookup(ledger.open_lease("c", "llama"), KEYS[:1]) == [1]


def test_a_closed_lease_keeps_its_published_pages_cached(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 4)
    ledger.update(worker, publish=[(KEYS[0], 1), (KEYS[1], 2)])
    assert ledger.close_lease(worker) == (2, 2)
    counts = ledger.counts()
    assert (counts.free_pages, counts.cached_pages, counts.evictable_pages) == (6, 2, 2)
    assert ledger.lookup(ledger.open_lease("next", "m"), KEYS) == [1, 2]
    ledger.check_invariants()


# Eviction ---------------------------------------------------------------------------------------------------


def test_evicts_least_recently_used_idle_pages_when_short() -> None:
    ledger = PageLedger(5)  # pages 1..4
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 4)
    ledger.update(worker, publish=[(key, page) for key, page in zip(KEYS, [1, 2, 3, 4], strict=True)])
    ledger.update(worker, unref=[3, 1, 4, 2])  # idle order, oldest first: 3, 1, 4, 2
    assert ledger.grant(worker, 2) == [1, 3]  # evicted 3 then 1; the free list is a stack
    assert ledger.evictions == 2
    assert ledger.lookup(worker, KEYS) == []  # KEYS[0] (page 1) is gone, so the chain breaks at once
    assert ledger.lookup(worker, KEYS[2:3]) == []
    assert ledger.lookup(worker, KEYS[1:2]) == [2]
    assert ledger.lookup(worker, KEYS[3:]) == [4]
    assert ledger.index.cached_pages == 2
    ledger.check_invariants()


def test_a_looked_up_page_is_not_evictable_until_released() -> None:
    ledger = PageLedger(3)  # pages 1..2
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 2)
    ledger.update(worker, publish=[(KEYS[0], 1), (KEYS[1], 2)])
    ledger.update(worker, unref=[1, 2])
    reader = ledger.open_lease("reader", "m")
    assert ledger.lookup(reader, KEYS[:1]) == [1]
    assert ledger.grant(worker, 2, need=2) is None  # page 1 is referenced again
    assert ledger.grant(worker, 2) == [2]
    ledger.check_invariants()


def test_eviction_keeps_the_low_watermark_free() -> None:
    ledger = PageLedger(11, low_watermark=3)  # pages 1..10
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 6)
    ledger.update(worker, publish=[(key, page) for key, page in zip(KEYS, [1, 2, 3, 4], strict=True)])
    ledger.update(worker, unref=[1, 2, 3, 4])
    assert ledger.free_pages == 4
    assert ledger.grant(worker, 2) == [7, 8]  # free falls to 2, below 3: one eviction, the oldest (page 1)
    assert ledger.free_pages == 3
    assert ledger.evictions == 1
    assert ledger.lookup(worker, KEYS[1:2]) == [2]
    ledger.check_invariants()


# Refills and reclaim ----------------------------------------------------------------------------------------


def test_refill_follows_recent_consumption() -> None:
    now = [0.0]
    ledger = PageLedger(
        4097,
        refill=RefillSettings(min_pages=8, max_pages=512, horizon_s=1.0, half_life_s=1.0),
        clock=lambda: now[0],
    )
    busy, quiet = ledger.open_lease("busy", "m"), ledger.open_lease("quiet", "m")
    assert len(ledger.refill(busy, need=0, consumed=0, idle=0)) == 8
    assert len(ledger.refill(quiet, need=0, consumed=0, idle=0)) == 8
    for _ in range(10):  # busy burns 100 pages a second, quiet 2
        now[0] += 1.0
        busy_pages = ledger.refill(busy, need=0, consumed=100, idle=0)
        quiet_pages = ledger.refill(quiet, need=0, consumed=2, idle=0)
    assert len(busy_pages) == 100  # 100 * (1 - 0.5**10) pages a second, rounded up
    assert len(quiet_pages) == 8
    assert busy.refill.pages == len(busy_pages)
    # A worker still holding idle pages is only topped up.
    now[0] += 1.0
    assert len(ledger.refill(busy, need=0, consumed=100, idle=60)) == busy.refill.pages - 60
    # The rate is per second and forgets by half each half-life, whatever the calls' spacing: 100 pages in
    # half a second (200 a second) move it 1 - 0.5**0.5 of the way from ~100, and two quiet seconds leave
    # a quarter of that.
    now[0] += 0.5
    assert len(ledger.refill(busy, need=0, consumed=100, idle=0)) == 130  # 99.95 + 0.293 * 100.05
    now[0] += 2.0
    assert len(ledger.refill(busy, need=0, consumed=0, idle=0)) == 33  # 129.25 / 4
    ledger.check_invariants()


def test_a_refill_tops_up_the_workers_idle_pages_and_counts_them_idle() -> None:
    """What a worker holds idle decides whom the daemon asks for pages when it runs short."""
    ledger = PageLedger(65, refill=RefillSettings(min_pages=8, max_pages=8))
    worker = ledger.open_lease("w", "m")
    pages = ledger.refill(worker, need=0, consumed=0, idle=3)
    assert pages is not None and len(pages) == 5
    assert [usage.idle_pages for usage in ledger.counts().workers] == [8]
    ledger.check_invariants()


def test_refill_takes_at_most_half_of_what_is_left_unless_needed() -> None:
    ledger = PageLedger(41, refill=RefillSettings(min_pages=32, max_pages=32))  # pages 1..40
    worker = ledger.open_lease("w", "m")
    assert len(ledger.refill(worker, need=0, consumed=0, idle=0)) == 20
    assert len(ledger.refill(worker, need=15, consumed=0, idle=20)) == 15


def test_reclaim_plan_asks_the_idlest_other_workers() -> None:
    ledger = PageLedger(100)
    a, b, c = (ledger.open_lease(name, "m") for name in "abc")
    ledger.report_idle(a, 10)
    ledger.report_idle(b, 30)
    ledger.report_idle(c, 50)
    assert ledger.reclaim_plan(c, shortfall=35) == [(b, 30), (a, 5)]


# Bad input: every call below is refused whole, and the counts do not move -----------------------------------


def _assert_unchanged(ledger: PageLedger, before: object) -> None:
    assert ledger.counts() == before
    ledger.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"release": [5]}, FailedPrecondition, "page 5: it is already free (a double free?)"),
        ({"release": [1, 1]}, FailedPrecondition, "cannot release page 1 twice"),
        (
            {"release": [3]},
            PermissionDenied,
            "page 3: it is leased to worker 'other' (id 2), not to worker 'w'",
        ),
        ({"release": [0]}, InvalidArgument, "page 0 is the null page"),
        ({"release": [99]}, InvalidArgument, "page 99 is out of range: this pool's pages are 1..8"),
        (
            {"release": [2]},
            FailedPrecondition,
            "page 2: it is shared, not leased; drop your reference with unref",
        ),
        (
            {"unref": [1]},
            FailedPrecondition,
            "cannot unref page 1: it is leased, not shared; release it instead",
        ),
        (
            {"unref": [2, 2]},
            FailedPrecondition,
            "unref page 2 2 time(s): worker 'w' (id 1) holds 1 reference(s)",
        ),
        (
            {"publish": [(KEYS[1], 3)]},
            PermissionDenied,
            "cannot publish page 3: it is leased to worker 'other'",
        ),
        ({"publish": [(b"", 1)]}, InvalidArgument, "a page key must be 1 to 64 bytes, got 0"),
        ({"publish": [(KEYS[1], 1)], "release": [1]}, FailedPrecondition, "both published and released"),
        ({"release": [1], "unref": [9]}, InvalidArgument, "page 9 is out of range"),
        # A good change that would be applied before the bad one, were each checked as it is applied.
        ({"publish": [(KEYS[1], 1)], "release": [5]}, FailedPrecondition, "page 5: it is already free"),
        ({"unref": [2], "release": [3]}, PermissionDenied, "cannot release page 3: it is leased to worker"),
    ],
)
def test_bad_updates_are_refused_whole(kwargs: dict, error: type[Exception], message: str) -> None:
    ledger = PageLedger(9)
    worker, other = ledger.open_lease("w", "m"), ledger.open_lease("other", "m")
    ledger.grant(worker, 2)  # pages 1, 2
    ledger.grant(other, 1)  # page 3
    ledger.update(worker, publish=[(KEYS[0], 2)])
    before = ledger.counts()
    with pytest.raises(error) as caught:
        ledger.update(worker, **kwargs)
    assert message in str(caught.value)
    _assert_unchanged(ledger, before)


def test_publish_then_unref_in_one_batch_is_valid(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 1)
    ledger.update(worker, publish=[(KEYS[0], 1)], unref=[1])
    assert ledger.counts().evictable_pages == 1
    ledger.check_invariants()


@pytest.mark.parametrize(
    ("need", "consumed", "idle"), [(-1, 0, 0), (9, 0, 0), (0, -5, 0), (0, 0, 10**9), (10**12, 0, 0)]
)
def test_absurd_refill_sizes_are_refused(ledger: PageLedger, need: int, consumed: int, idle: int) -> None:
    worker = ledger.open_lease("w", "m")
    before = ledger.counts()
    with pytest.raises(InvalidArgument, match="must be between 0 and the pool's 8 pages"):
        ledger.refill(worker, need, consumed, idle)
    _assert_unchanged(ledger, before)


def test_too_many_lookup_keys_are_refused(ledger: PageLedger) -> None:
    with pytest.raises(InvalidArgument, match="20 keys is more than the pool's 8 pages"):
        ledger.lookup(ledger.open_lease("w", "m"), [b"k"] * 20)


def test_a_pool_needs_two_pages() -> None:
    with pytest.raises(InvalidArgument, match="at least 2 pages"):
        PageLedger(1)


def _free_twice(ledger: PageLedger) -> None:
    ledger._free.append(ledger._free[-1])


def _leased_page_freed_behind_the_books(ledger: PageLedger) -> None:
    lease = next(iter(ledger.leases.values()))
    ledger._free.append(max(lease.pages))


def _a_reference_too_many(ledger: PageLedger) -> None:
    ledger._refs[1] += 1


def _a_cached_page_no_one_published(ledger: PageLedger) -> None:
    ledger.publishers.forget(1)


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [
        (_free_twice, "a page is on the free list twice"),
        (_leased_page_freed_behind_the_books, "a page on the free list is not free"),
        (_a_reference_too_many, "page 1: 2 refs, 1 held"),
        (_a_cached_page_no_one_published, "page 1: index and publishers"),
    ],
)
def test_the_books_audit_names_what_does_not_balance(
    ledger: PageLedger, corrupt: Callable[[PageLedger], None], named: str
) -> None:
    """check_invariants is what many tests take as proof that no page leaked: it passes on sound books and
    raises Internal, naming the fault, on each kind of corruption."""
    lease = ledger.open_lease("w", "m")
    pages = ledger.grant(lease, 3)
    assert pages == [1, 2, 3]
    ledger.update(lease, publish=[(KEYS[0], 1)])
    ledger.check_invariants()
    corrupt(ledger)
    with pytest.raises(Internal, match=re.escape(named)):
        ledger.check_invariants()
