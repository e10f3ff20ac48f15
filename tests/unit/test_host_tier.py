"""The host-memory tier (--kv-host-memory) alone and in front of the disk tier: its budget, the pages it lets
go on to the disk, promotions from host memory first, the index's events by medium, and a graceful stop
that hands its pages down to the disk."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from memory_daemon.disk_tier import DiskTier, StoredPage, fingerprint
from memory_daemon.host_tier import HostTier
from memory_daemon.ledger import PageLedger
from memory_daemon.prefix import Published, page_keys
from memory_daemon.prefix_events import DISK, HOST, POOL, Cleared
from memory_daemon.publishers import PROMOTED
from memory_daemon.shape import PoolShape
from memory_daemon.tiers import PoolTier, ShmPageCopier

OWNER = fingerprint("model-a", "shape")
SHAPE = PoolShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4)
OWNER_OF_M = fingerprint("m", SHAPE)  # what the tiers keep model m's pages under


def stored(key: bytes, size: int = 100) -> StoredPage:
    return StoredPage(key, b"", (1, 2, 3, 4), bytes([len(key)]) * size)


def test_the_budget_holds_the_most_recently_used_and_hands_the_rest_back() -> None:
    tier = HostTier(capacity_bytes=250)
    assert tier.put(OWNER, stored(b"a")) == [] and tier.put(OWNER, stored(b"b")) == []
    assert tier.get(OWNER, b"a") is not None  # a is now the most recent: b goes first
    let_go = tier.put(OWNER, stored(b"c"))
    assert [page.key for _, page in let_go] == [b"b"]
    assert tier.has(OWNER, b"a") and tier.has(OWNER, b"c") and not tier.has(OWNER, b"b")
    assert tier.put(OWNER, stored(b"huge", 251)) == [(OWNER, stored(b"huge", 251))]  # larger than all
    counts = tier.counts()
    assert (counts.pages, counts.bytes, counts.demotions, counts.dropped) == (2, 200, 3, 1)
    assert tier.discard_owner(OWNER) == 2 and tier.counts().bytes == 0


def test_a_drain_hands_every_page_down_least_recently_used_first() -> None:
    """A graceful stop writes the drained pages to the disk in this order, so that a disk short of room
    drops the oldest of them for the newer."""
    tier = HostTier(capacity_bytes=1000)
    for key in (b"a", b"b", b"c"):
        tier.put(OWNER, stored(key))
    assert tier.get(OWNER, b"a") is not None  # now the most recent
    assert [page.key for _, page in tier.drain()] == [b"b", b"c", b"a"]
    assert tier.counts().pages == 0 and tier.counts().bytes == 0 and not tier.has(OWNER, b"a")


class Pool:
    """A ledger of `pages` pages over an in-memory pool, its tiers, and a prompt of three pages published
    by a lease and left idle."""

    def __init__(self, tmp_path: Path, pages: int, host_pages: int, disk: bool) -> None:
        self.memory = mmap.mmap(-1, pages * SHAPE.page_bytes)
        self.copier = ShmPageCopier(self.memory, SHAPE, pages)
        self.host = HostTier(host_pages * SHAPE.page_bytes)
        self.disk = DiskTier(tmp_path, 1 << 20, background=False) if disk else None
        self.ledger = PageLedger(pages, tier=PoolTier(self.host, self.disk, self.copier, SHAPE))
        self.lease = self.ledger.open_lease("w", "m")
        self.tokens = list(range(12))
        self.keys = page_keys(self.tokens, SHAPE.page_size)
        self.watcher = self.ledger.index.events_of("m").subscribe(0)
        held = self.ledger.grant(self.lease, 3)
        assert held is not None
        self.contents = [bytes([value]) * SHAPE.page_bytes for value in (11, 22, 33)]
        parents = [b"", *self.keys[:-1]]
        published = []
        for i, (key, page) in enumerate(zip(self.keys, held, strict=True)):
            self.copier.write(page, self.contents[i])
            published.append(Published(key, page, parents[i], tuple(self.tokens[4 * i : 4 * i + 4])))
        self.ledger.update(self.lease, publish=published)
        self.ledger.update(self.lease, unref=held)
        self.changes()

    def evict_all(self) -> None:
        """A lease takes every page (evicting the prompt's), then gives them back."""
        taken = self.ledger.grant(self.lease, self.ledger.free_pages + self.ledger.index.evictable_pages)
        assert taken is not None and self.ledger.index.cached_pages == 0
        self.ledger.update(self.lease, release=taken)
        self.ledger.check_invariants()

    def changes(self) -> list[tuple[str, int, str]]:
        """The index's events since the last call, as (what, page of the chain, medium)."""
        seen = []
        while not self.watcher._queue.empty():
            for change in self.watcher._queue.get_nowait().changes:  # type: ignore[union-attr]
                if not isinstance(change, Cleared):
                    seen.append((type(change).__name__, self.keys.index(change.key), change.medium))
        return seen


def test_evicted_pages_go_to_host_memory_and_come_back_from_it(tmp_path: Path) -> None:
    pool = Pool(tmp_path, pages=5, host_pages=8, disk=True)
    pool.evict_all()
    assert pool.host.counts().demotions == 3 and pool.disk is not None and pool.disk.counts().pages == 0
    assert sorted(pool.changes()) == sorted(
        [("Removed", i, POOL) for i in range(3)] + [("Stored", i, HOST) for i in range(3)]
    )

    found = pool.ledger.lookup(pool.lease, pool.keys)
    assert [pool.copier.read(page) for page in found] == pool.contents
    assert pool.host.counts().promotions == 3 and pool.disk.counts().promotions == 0
    assert pool.host.counts().bytes_read == 3 * SHAPE.page_bytes
    assert sorted(pool.changes()) == [("Stored", i, POOL) for i in range(3)]  # and still in host memory
    pool.ledger.update(pool.lease, unref=found)
    assert pool.ledger.flush("m") == 3 and pool.host.counts().pages == 0
    assert sorted(pool.changes()) == sorted([("Removed", i, m) for i in range(3) for m in (HOST, POOL)])
    pool.ledger.check_invariants()


def test_pages_host_memory_lets_go_go_on_to_the_disk_and_come_back_from_there(tmp_path: Path) -> None:
    pool = Pool(tmp_path, pages=5, host_pages=1, disk=True)
    pool.evict_all()  # three pages through a host tier of one: the two oldest spill to the disk
    assert pool.disk is not None and pool.disk.counts().pages == 2 and pool.host.counts().pages == 1
    assert pool.host.counts().dropped == 2
    events = pool.changes()
    assert events.count(("Stored", 2, HOST)) == 1 and ("Stored", 0, DISK) in events
    assert ("Removed", 0, HOST) in events and ("Stored", 1, DISK) in events

    found = pool.ledger.lookup(pool.lease, pool.keys)
    assert [pool.copier.read(page) for page in found] == pool.contents
    assert (pool.disk.counts().promotions, pool.host.counts().promotions) == (2, 1)
    pool.ledger.update(pool.lease, unref=found)
    pool.ledger.check_invariants()


def test_without_a_disk_the_pages_host_memory_lets_go_are_dropped(tmp_path: Path) -> None:
    pool = Pool(tmp_path, pages=5, host_pages=1, disk=False)
    pool.evict_all()
    assert pool.host.counts().pages == 1
    found = pool.ledger.lookup(pool.lease, pool.keys)
    assert found == []  # the chain's first page is gone, so nothing after it can be reached
    assert ("Removed", 0, HOST) in pool.changes()
    # The publisher is forgotten with a copy no tier keeps: a drop counts only the one host memory kept.
    assert pool.ledger.drop_published(name="w") == 1


def test_a_page_flushed_while_a_prefetch_reads_it_does_not_come_back(tmp_path: Path) -> None:
    pool = Pool(tmp_path, pages=5, host_pages=8, disk=False)
    pool.evict_all()
    tier = pool.ledger.tier
    assert tier is not None
    reading = tier.read("m", pool.keys)  # the prefetch's read, on its thread, after the event loop's turn
    assert pool.ledger.flush("m") == 0 and pool.host.counts().pages == 0  # meanwhile, on the loop
    assert pool.ledger.admit_promoted("m", tier.settle("m", reading())) == 0
    assert pool.ledger.lookup(pool.lease, pool.keys) == []
    pool.ledger.check_invariants()


def test_a_page_both_tiers_keep_comes_back_from_host_memory_reading_no_file(tmp_path: Path) -> None:
    """A page host memory let go to the disk, promoted and evicted again, is in both tiers: a lookup and a
    prefetch's read take host memory's copy, and no file is read."""
    pool = Pool(tmp_path, pages=5, host_pages=1, disk=True)
    pool.evict_all()  # page 2 in host memory, pages 0 and 1 on disk
    pool.ledger.update(pool.lease, unref=pool.ledger.lookup(pool.lease, pool.keys))
    pool.evict_all()  # page 2 went on to the disk as pages 0 and 1 came through host memory, and came back
    assert pool.disk is not None and pool.disk.counts().pages == 3 and pool.host.has(OWNER_OF_M, pool.keys[2])
    tier = pool.ledger.tier
    assert tier is not None
    file_bytes = pool.disk.counts().bytes_read
    assert [read.name for read in tier.read("m", pool.keys[2:])()] == [""]  # no file to read
    # Into page 0, the null page no lease is given: a copy the ledger's books need not hear of.
    assert tier.promote("m", pool.keys[2], 0) is not None and pool.copier.read(0) == pool.contents[2]
    assert pool.disk.counts().bytes_read == file_bytes and pool.disk.counts().promotions == 2


def test_a_prefetchs_pages_are_announced_in_the_pool_at_once(tmp_path: Path) -> None:
    """admit_promoted (a prefetch's) ends its call's batch of events, as a lookup does: a watcher hears of
    the pages back in the pool before anything else happens."""
    pool = Pool(tmp_path, pages=5, host_pages=8, disk=False)
    pool.evict_all()
    pool.changes()
    tier = pool.ledger.tier
    assert tier is not None
    assert pool.ledger.admit_promoted("m", tier.settle("m", tier.read("m", pool.keys)())) == 3
    assert sorted(pool.changes()) == [("Stored", i, POOL) for i in range(3)]


def test_host_pages_drained_to_the_disk_serve_a_restarted_ledger(tmp_path: Path) -> None:
    """What the daemon's graceful stop builds on (that it drains the host tier is test_kv_tiers')."""
    pool = Pool(tmp_path, pages=5, host_pages=8, disk=True)
    pool.evict_all()
    assert pool.disk is not None
    for owner, page in pool.host.drain():
        pool.disk.put(owner, page)
    assert pool.host.counts().pages == 0 and pool.disk.counts().pages == 3
    restarted = PageLedger(
        5, tier=PoolTier(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20), pool.copier, SHAPE)
    )
    found = restarted.lookup(restarted.open_lease("again", "m"), pool.keys)
    assert [pool.copier.read(page) for page in found] == pool.contents
    # Who published them was the old daemon's to know: they name the tier.
    assert {usage.name for usage in restarted.counts().publishers} == {PROMOTED}


def test_a_tier_that_fails_a_copy_costs_the_pool_no_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion or an admitted read takes a free page for the tier's copy: if the tier raises there (a
    read error the tier did not foresee), the page goes back on the free list and the books balance."""
    pool = Pool(tmp_path, pages=5, host_pages=8, disk=False)
    pool.evict_all()
    tier = pool.ledger.tier
    assert tier is not None
    free = pool.ledger.free_pages
    reading = tier.read("m", pool.keys)()

    def fails(*_: object) -> None:
        raise OSError("the copy failed")

    for method in ("promote", "install"):
        monkeypatch.setattr(tier, method, fails)
    with pytest.raises(OSError):
        pool.ledger.lookup(pool.lease, pool.keys)
    with pytest.raises(OSError):
        pool.ledger.admit_promoted("m", tier.settle("m", reading))
    assert pool.ledger.free_pages == free
    pool.ledger.check_invariants()


def test_a_publishers_pages_are_dropped_from_the_tiers_too_and_come_back_under_its_name(
    tmp_path: Path,
) -> None:
    """drop_published reaches a worker's pages after the pool demoted them to host memory or disk, and a
    page promoted back still names the worker that published it."""
    pool = Pool(tmp_path, pages=5, host_pages=1, disk=True)  # one page in host memory, two on disk
    pool.evict_all()
    found = pool.ledger.lookup(pool.lease, pool.keys[:1])
    assert {usage.name for usage in pool.ledger.counts().publishers} == {"w"}
    pool.ledger.update(pool.lease, unref=found)
    assert pool.ledger.drop_published(name="w") == 3
    assert pool.ledger.lookup(pool.lease, pool.keys) == []
    assert pool.host.counts().pages == 0 and pool.disk is not None and pool.disk.counts().pages == 0
    assert pool.ledger.publishers._in_tiers == {}
    pool.ledger.check_invariants()
