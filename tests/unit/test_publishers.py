"""Who published each cached page, and dropping every entry of one worker, attached or gone. The `ledger`
fixture (tests/unit/conftest.py) is a pool of the null page and pages 1..8."""

from __future__ import annotations

import pytest

from memory_daemon.ledger import PageLedger
from memory_daemon.stats import PublisherUsage
from pagedserve.plumbing.errors import InvalidArgument
from tests.unit.ledgers import KEYS


def test_each_indexed_page_names_its_publisher(ledger: PageLedger) -> None:
    a, b = ledger.open_lease("a", "m"), ledger.open_lease("b", "m")
    ledger.grant(a, 2)
    ledger.grant(b, 2)
    ledger.update(a, publish=[(KEYS[0], 1), (KEYS[1], 2)])
    ledger.update(b, publish=[(KEYS[0], 3), (KEYS[2], 4)])  # KEYS[0] is a's: page 3 is not indexed
    assert ledger.counts().publishers == (
        PublisherUsage(a.worker_id, "a", "m", 2),
        PublisherUsage(b.worker_id, "b", "m", 1),
    )
    ledger.close_lease(a)
    assert ledger.counts().publishers[0] == PublisherUsage(a.worker_id, "a", "m", 2)  # gone, still cached
    ledger.check_invariants()


def test_dropping_a_publisher_frees_its_idle_pages_and_unindexes_the_rest(ledger: PageLedger) -> None:
    bad, reader = ledger.open_lease("bad", "m"), ledger.open_lease("reader", "m")
    ledger.grant(bad, 3)
    ledger.update(bad, publish=[(KEYS[0], 1), (KEYS[1], 2), (KEYS[2], 3)])
    ledger.close_lease(bad)  # three idle cached pages
    assert ledger.lookup(reader, KEYS[:1]) == [1]  # the reader holds page 1
    free = ledger.free_pages
    assert ledger.drop_published(name="bad") == 3
    assert ledger.free_pages == free + 2  # pages 2 and 3 at once
    assert ledger.lookup(reader, KEYS) == []
    counts = ledger.counts()
    assert (counts.cached_pages, counts.evictable_pages, counts.shared_pages) == (0, 0, 1)
    assert not counts.publishers
    ledger.check_invariants()
    ledger.update(reader, unref=[1])  # page 1 goes free, not back to the cache
    assert ledger.free_pages == free + 3 and ledger.counts().cached_pages == 0
    ledger.check_invariants()


def test_drop_by_worker_id_spares_a_namesake(ledger: PageLedger) -> None:
    first, second = ledger.open_lease("w", "m"), ledger.open_lease("w", "m")  # a worker and its restart
    ledger.grant(first, 1)
    ledger.grant(second, 1)
    ledger.update(first, publish=[(KEYS[0], 1)])
    ledger.update(second, publish=[(KEYS[1], 2)])
    assert ledger.drop_published(worker_id=first.worker_id) == 1
    assert ledger.lookup(second, KEYS[1:2]) == [2]
    assert ledger.drop_published(name="w") == 1
    assert ledger.drop_published(name="nobody") == 0
    with pytest.raises(InvalidArgument, match="name the publisher"):
        ledger.drop_published()
    ledger.check_invariants()


def test_an_evicted_page_forgets_its_publisher() -> None:
    ledger = PageLedger(3)  # pages 1 and 2
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 2)
    ledger.update(worker, publish=[(KEYS[0], 1)], release=[2])
    ledger.update(worker, unref=[1])
    assert sorted(ledger.grant(worker, 2) or []) == [1, 2]  # page 1 evicted
    assert not ledger.counts().publishers
    assert ledger.drop_published(name="w") == 0
    ledger.check_invariants()


def test_a_worker_publishes_only_under_its_own_lease_model(ledger: PageLedger) -> None:
    """The model id comes from the lease, never from an update: a worker of model "other" publishing the
    very keys of model "m" fills other's namespace only."""
    other, victim = ledger.open_lease("o", "other"), ledger.open_lease("v", "m")
    ledger.grant(other, 1)
    ledger.update(other, publish=[(KEYS[0], 1)])
    assert ledger.lookup(victim, KEYS[:1]) == []
    assert ledger.counts().publishers == (PublisherUsage(other.worker_id, "o", "other", 1),)
