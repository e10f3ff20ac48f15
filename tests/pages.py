"""Page accounting checks shared by the tests."""

from __future__ import annotations

from services.worker.kv.base import KVCache
from services.worker.kv.local import LocalKVCache


def assert_pages_back(kv: KVCache) -> None:
    """No sequence holds a page: every page is free, idle in this worker's lease, or cached unreferenced."""
    kv.flush()
    usage = kv.usage()
    assert (usage.in_use_pages, usage.referenced_pages) == (0, 0), usage
    counts = kv.stats()
    assert counts.free_pages + counts.leased_pages + counts.evictable_pages == counts.total_pages, counts
    assert counts.leased_pages == sum(worker.idle_pages for worker in counts.workers), counts
    if isinstance(kv, LocalKVCache):
        kv.ledger.check_invariants()
