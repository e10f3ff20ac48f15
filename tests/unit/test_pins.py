"""Pins in the page ledger (GenerateRequest.cache_ttl_seconds): a pinned page is never evicted until its last
pin ends, hits renew pins, and the per-tenant and per-pool budgets hold, with exact page ids and counts.

The pool here has 16 usable pages: a tenant may pin 4 (--tenant-pin-share 0.25) and all tenants 8
(--pin-share 0.5). The clock is a list the test moves by hand.
"""

from __future__ import annotations

import pytest

from memory_daemon.lease import Lease
from memory_daemon.ledger import PageLedger, PinRequest
from memory_daemon.prefix import page_keys
from pagedserve.plumbing.errors import InvalidArgument, ResourceExhausted

KEYS = page_keys(list(range(16 * 8)), page_size=16)  # eight chained keys


@pytest.fixture
def now() -> list[float]:
    return [100.0]


@pytest.fixture
def ledger(now: list[float]) -> PageLedger:
    return PageLedger(17, clock=lambda: now[0], pin_share=0.5, tenant_pin_share=0.25)


def cache(ledger: PageLedger, worker: Lease, count: int, *, pin: PinRequest | None = None) -> list[int]:
    """Publish the first `count` keys' pages, pin them as asked, and let go: cached, idle unless pinned."""
    pages = ledger.grant(worker, count)
    assert pages is not None and len(pages) == count
    ledger.update(worker, publish=list(zip(KEYS, pages, strict=False)), pin=[pin] if pin else [])
    ledger.update(worker, unref=pages)
    return pages


def test_a_pinned_page_outlives_pressure_until_its_pin_ends(ledger: PageLedger, now: list[float]) -> None:
    worker = ledger.open_lease("w", "m")
    pinned = cache(ledger, worker, 2, pin=PinRequest(KEYS[:2], 30, "alice"))
    counts = ledger.counts()
    assert (counts.pinned_pages, counts.evictable_pages, counts.cached_pages) == (2, 0, 2)
    assert ledger.grant(worker, 15, need=15) is None  # only 14 pages can be had: the pinned two are not
    taken = ledger.grant(worker, 14, need=14)
    assert taken is not None and not set(taken) & set(pinned)
    ledger.update(worker, release=taken)
    now[0] += 29.9
    assert ledger.counts().pinned_pages == 2
    now[0] += 0.2  # the pin is over: the pages are cached as any others, and evictable
    counts = ledger.counts()
    assert (counts.pinned_pages, counts.evictable_pages, counts.tenants) == (0, 2, ())
    assert ledger.grant(worker, 16, need=16) is not None
    assert ledger.counts().evictions == 2
    ledger.check_invariants()


def test_a_hit_renews_every_pin_on_its_pages(ledger: PageLedger, now: list[float]) -> None:
    worker = ledger.open_lease("w", "m")
    pages = cache(ledger, worker, 2, pin=PinRequest(KEYS[:2], 30, "alice"))
    now[0] += 20
    assert ledger.lookup(worker, KEYS[:1]) == pages[:1]  # renews the first page's pin alone
    ledger.update(worker, unref=pages[:1])
    now[0] += 20  # 40 s after the pin, 20 after the hit
    counts = ledger.counts()
    assert counts.pinned_pages == 1 and counts.evictable_pages == 1
    ledger.check_invariants()
    now[0] += 10.1
    assert ledger.counts().pinned_pages == 0


def test_a_hit_renews_each_tenants_pin_by_its_own_ttl(ledger: PageLedger, now: list[float]) -> None:
    worker = ledger.open_lease("w", "m")
    (page,) = cache(ledger, worker, 1, pin=PinRequest(KEYS[:1], 60, "alice"))
    ledger.update(worker, pin=[PinRequest(KEYS[:1], 10, "bob")])
    now[0] += 5
    assert ledger.lookup(worker, KEYS[:1]) == [page]  # alice's pin now ends at +65 s, bob's at +15 s
    ledger.update(worker, unref=[page])
    now[0] += 7  # past the end of bob's pin as he made it
    assert [tenant.tenant for tenant in ledger.counts().tenants] == ["alice", "bob"]
    now[0] += 3.1
    assert [tenant.tenant for tenant in ledger.counts().tenants] == ["alice"]
    ledger.check_invariants()


def test_pages_pinned_already_cost_their_tenant_nothing_and_the_pool_nothing(ledger: PageLedger) -> None:
    """A conversation that goes on sends its pinned prompt again, and more: only the pages it does not pin
    yet count against its budget, and pages another tenant pins count against the pool's."""
    worker = ledger.open_lease("w", "m")
    cache(ledger, worker, 7, pin=PinRequest(KEYS[:3], 60, "alice"))
    ledger.update(worker, pin=[PinRequest(KEYS[3:7], 60, "bob")])  # 7 of the pool's 8 pinned
    ledger.check_pins("alice", 4, 1, "m", KEYS[:4])  # 3 of them hers: 1 more, her 4th
    with pytest.raises(ResourceExhausted, match=r"has pinned 3 of the 4 pages .* would pin 2 more"):
        ledger.check_pins("alice", 5, 1, "m", KEYS[:5])
    with pytest.raises(ResourceExhausted, match="would pin 4 more"):
        ledger.check_pins("alice", 4, 1)  # the same pages, unnamed
    ledger.check_pins("carol", 4, 1, "m", KEYS[3:7])  # bob's: they cost the pool nothing
    with pytest.raises(ResourceExhausted, match=r"all tenants together have pinned 7 of the 8 .* pin 2 more"):
        ledger.check_pins("carol", 4, 1, "m", KEYS[5:7])
    with pytest.raises(ResourceExhausted, match="would pin 4 more"):
        ledger.check_pins("carol", 4, 1, "another model", KEYS[3:7])  # another model's keys name no page
    with pytest.raises(InvalidArgument, match="2 keys for 1 pages"):
        ledger.check_pins("carol", 1, 1, "m", KEYS[:2])


def test_a_shorter_pin_by_the_same_tenant_keeps_the_longer_ttl(ledger: PageLedger, now: list[float]) -> None:
    """A tenant's pin is renewed, not cut, by a pin of its own with a shorter TTL: the longer one holds."""
    worker = ledger.open_lease("w", "m")
    cache(ledger, worker, 1, pin=PinRequest(KEYS[:1], 60, "alice"))
    now[0] += 1
    ledger.update(worker, pin=[PinRequest(KEYS[:1], 10, "alice")])  # renews her pin to +61 s, not +11 s
    now[0] += 30
    assert [(t.tenant, t.pinned_pages) for t in ledger.counts().tenants] == [("alice", 1)]
    now[0] += 30.1
    assert ledger.counts().pinned_pages == 0
    ledger.check_invariants()


def test_a_referenced_page_whose_pin_ends_stays_in_use(ledger: PageLedger, now: list[float]) -> None:
    worker = ledger.open_lease("w", "m")
    cache(ledger, worker, 1, pin=PinRequest(KEYS[:1], 5, "alice"))
    (page,) = ledger.lookup(worker, KEYS[:1])
    now[0] += 6
    assert ledger.counts().evictable_pages == 0  # unpinned, but referenced
    ledger.update(worker, unref=[page])
    assert ledger.counts().evictable_pages == 1
    ledger.check_invariants()


def test_budgets_bound_each_tenant_and_the_pool(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    cache(ledger, worker, 6, pin=PinRequest(KEYS[:6], 60, "alice"))
    counts = ledger.counts()
    assert (counts.pinned_pages, counts.pins_refused) == (4, 2)  # the chain's head is what stays pinned
    assert (counts.pin_budget_pages, counts.tenant_pin_budget_pages) == (8, 4)
    with pytest.raises(ResourceExhausted, match=r"tenant 'alice' has pinned 4 of the 4 .*--tenant-pin-share"):
        ledger.check_pins("alice", 1, pool_id=3)
    ledger.check_pins("bob", 4, pool_id=3)
    assert (ledger.pins.room("alice"), ledger.pins.room("bob")) == (0, 4)  # what CheckPins answers
    ledger.update(worker, pin=[PinRequest(KEYS[2:6], 60, "bob")])  # two of alice's pages, two new
    ledger.update(worker, pin=[PinRequest(KEYS[6:8], 60, "carol")])  # pages that are not cached: nothing
    counts = ledger.counts()
    assert counts.pinned_pages == 6
    assert ledger.pins.room("carol") == 2  # her own budget has 4, the pool's 2
    assert [(t.tenant, t.pinned_pages) for t in counts.tenants] == [("alice", 4), ("bob", 4)]
    more = ledger.grant(worker, 2)
    assert more is not None
    ledger.update(worker, publish=list(zip(KEYS[6:8], more, strict=True)))
    ledger.update(worker, pin=[PinRequest(KEYS[6:8], 60, "carol")], unref=more)
    assert ledger.counts().pinned_pages == 8
    with pytest.raises(
        ResourceExhausted, match=r"all tenants together have pinned 8 of the 8 .*--pin-share 0.5"
    ):
        ledger.check_pins("dave", 1, pool_id=3)
    # A page pinned already costs the pool nothing: with the pool's budget spent, dave may pin one of those.
    ledger.update(worker, pin=[PinRequest(KEYS[:1], 60, "dave")])
    counts = ledger.counts()
    assert (counts.pinned_pages, counts.pins_refused) == (8, 2)
    assert ("dave", 1) in [(t.tenant, t.pinned_pages) for t in counts.tenants]
    ledger.check_invariants()


def test_a_page_two_tenants_pin_stays_pinned_until_the_later_pin_ends(
    ledger: PageLedger, now: list[float]
) -> None:
    worker = ledger.open_lease("w", "m")
    cache(ledger, worker, 1, pin=PinRequest(KEYS[:1], 10, "alice"))
    ledger.update(worker, pin=[PinRequest(KEYS[:1], 60, "bob")])
    now[0] += 11
    counts = ledger.counts()
    assert counts.pinned_pages == 1 and [t.tenant for t in counts.tenants] == ["bob"]
    now[0] += 50
    assert ledger.counts().pinned_pages == 0
    ledger.check_invariants()


def test_flush_and_a_distrusted_publisher_take_pinned_pages_with_their_pins(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    cache(ledger, worker, 2, pin=PinRequest(KEYS[:2], 60, "alice"))
    assert ledger.flush("m") == 2
    counts = ledger.counts()
    assert (counts.pinned_pages, counts.cached_pages, counts.free_pages, counts.tenants) == (0, 0, 16, ())
    cache(ledger, worker, 2, pin=PinRequest(KEYS[:2], 60, "alice"))
    assert ledger.drop_published(worker_id=worker.worker_id) == 2
    assert ledger.counts().pinned_pages == 0
    ledger.check_invariants()


def test_pins_outlive_the_lease_that_made_them(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    pages = cache(ledger, worker, 2, pin=PinRequest(KEYS[:2], 60, "alice"))
    ledger.close_lease(worker)
    other = ledger.open_lease("w2", "m")
    assert ledger.grant(other, 15, need=15) is None
    assert ledger.lookup(other, KEYS[:2]) == pages
    ledger.check_invariants()


@pytest.mark.parametrize(
    ("pin", "message"),
    [
        (PinRequest(KEYS[:1], 86401, "alice"), "cache_ttl_seconds is 86401"),
        (PinRequest(KEYS[:1], -1, "alice"), "cache_ttl_seconds is -1"),
        (PinRequest(KEYS[:1], 60, ""), "tenant must be 1 to 256 bytes"),
        (PinRequest(KEYS[:1], 60, "x" * 257), "tenant must be 1 to 256 bytes"),
        (PinRequest([b""], 60, "alice"), "a page key must be 1 to 64 bytes"),
    ],
)
def test_a_bad_pin_changes_nothing(ledger: PageLedger, pin: PinRequest, message: str) -> None:
    worker = ledger.open_lease("w", "m")
    pages = ledger.grant(worker, 1)
    assert pages is not None
    with pytest.raises(InvalidArgument, match=message):
        ledger.update(worker, publish=[(KEYS[0], pages[0])], pin=[pin])
    counts = ledger.counts()
    assert (counts.cached_pages, counts.pinned_pages, counts.leased_pages) == (0, 0, 1)
    with pytest.raises(InvalidArgument, match="pages must be at least 0"):
        ledger.check_pins("alice", -1, pool_id=1)
    ledger.check_invariants()


def test_renewing_a_hot_pin_keeps_the_expiry_heap_small(ledger: PageLedger, now: list[float]) -> None:
    worker = ledger.open_lease("w", "m")
    cache(ledger, worker, 1, pin=PinRequest(KEYS[:1], 60, "alice"))
    for _ in range(5000):
        (page,) = ledger.lookup(worker, KEYS[:1])
        ledger.update(worker, unref=[page])
        now[0] += 0.01
    assert len(ledger.pins._heap) <= 1024 + 4
    now[0] += 60.1
    assert ledger.counts().pinned_pages == 0


def test_a_pin_may_name_more_keys_than_the_pool_has_pages(ledger: PageLedger) -> None:
    """A pin names every layer group's keys, and a sliding window's pages leave the pool as its sequence
    runs: keys the pool no longer has are skipped, never refused (a refusal would drop the whole update)."""
    worker = ledger.open_lease("w", "m")
    gone = page_keys(list(range(1000, 1000 + 16 * 40)), page_size=16)  # 40 keys, for a 16-page pool
    cache(ledger, worker, 2, pin=PinRequest([*gone, *KEYS[:2]], 30, "alice"))
    assert ledger.counts().pinned_pages == 2
    ledger.check_invariants()
