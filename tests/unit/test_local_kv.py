"""The worker-side KV cache over the in-process ledger: local sub-allocation, publish, lookup and free."""

from __future__ import annotations

import pytest
import torch

from memory_daemon.prefix import page_keys
from memory_daemon.refill import RefillSettings
from memory_daemon.shape import PoolShape
from services.worker.kv.local import LocalKVCache

SHAPE = PoolShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)


def make_cache(num_pages: int = 65, min_refill: int = 8) -> LocalKVCache:
    return LocalKVCache(SHAPE, num_pages, refill=RefillSettings(min_pages=min_refill, max_pages=min_refill))


def test_the_pool_tensor_has_one_slot_per_page_in_every_layer() -> None:
    cache = make_cache()
    assert cache.kv.shape == (2, 2, 65, 4, 2, 8)
    assert cache.kv.dtype == torch.float32


def test_allocation_comes_from_one_bulk_lease() -> None:
    cache = make_cache()
    assert cache.allocate(3) == [6, 7, 8]  # a refill of 8 pages; allocation pops from the top
    assert cache.allocate(1) == [5]
    counts = cache.stats()
    assert (counts.leased_pages, counts.free_pages) == (8, 56)
    assert cache.usage().idle_pages == 4 and cache.usage().in_use_pages == 4


def test_running_low_triggers_a_refill_and_a_large_idle_list_is_returned() -> None:
    cache = make_cache()
    cache.allocate(5)  # idle 3 < 8 // 2: topped up to the refill size
    assert cache.usage().idle_pages == 8
    assert cache.stats().leased_pages == 13
    pages = cache.allocate(10)
    cache.free(pages)
    assert cache.usage().idle_pages <= 16  # never more than twice the refill size
    assert cache.stats().leased_pages == cache.usage().idle_pages + cache.usage().in_use_pages
    cache.ledger.check_invariants()


def test_no_room_now_is_none_and_more_than_the_pool_is_an_error() -> None:
    cache = make_cache(num_pages=9)
    held = cache.allocate(6)
    assert cache.allocate(3) is None  # two pages left
    assert cache.usage().in_use_pages == 6
    assert len(cache.allocate(2)) == 2
    cache.free(held)
    with pytest.raises(ValueError, match="allocate takes 1 to the pool's 8 pages, got 9"):
        cache.allocate(9)


def test_published_pages_are_found_by_lookup_and_stay_cached_after_free() -> None:
    cache = make_cache()
    tokens = list(range(10))  # two full pages of 4, and a partial one
    pages = cache.allocate(3)
    keys = page_keys(tokens, SHAPE.page_size)
    assert cache.publish(keys, pages[:2]) == 2
    assert cache.publish(keys, pages[:2]) == 0  # already shared: skipped
    assert cache.lookup(keys) == pages[:2]
    cache.free(pages)  # the sequence ends: two unrefs and a local free
    cache.free(pages[:2])  # the lookup's references
    counts = cache.stats()
    assert (counts.cached_pages, counts.evictable_pages, counts.shared_pages) == (2, 2, 2)
    assert cache.lookup(page_keys([*tokens, 77, 78], SHAPE.page_size)) == pages[:2]
    cache.ledger.check_invariants()


def test_a_double_free_is_refused_before_anything_changes() -> None:
    cache = make_cache()
    pages = cache.allocate(2)
    cache.free(pages[:1])
    before = cache.usage()
    with pytest.raises(ValueError, match=f"page {pages[0]} is not held by this worker 1 time"):
        cache.free([pages[1], pages[0]])  # the good page first: it must not go back either
    assert cache.usage() == before
    with pytest.raises(ValueError, match="page 60 is not held"):
        cache.free([60])


def test_publishing_a_page_not_held_is_refused() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match="cannot publish page 3"):
        cache.publish([b"0123456789abcdef"], [3])
    with pytest.raises(ValueError, match="one key per page"):
        cache.publish([], [3])


def test_close_returns_every_page_and_keeps_the_cache() -> None:
    cache = make_cache()
    pages = cache.allocate(4)
    cache.publish(page_keys(list(range(4)), 4), pages[:1])
    cache.close()
    counts = cache.ledger.counts()
    assert counts.settled and counts.cached_pages == 1 and counts.workers == ()
