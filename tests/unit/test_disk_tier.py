"""The disk tier on a real folder: pages kept and read back whole, the budget, a restart's index, and every
file it must refuse (truncated, corrupt, another model's, renamed, planted as a symlink, open to others)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from memory_daemon.disk_tier import DiskTier, Kept, StoredPage, file_name, fingerprint
from memory_daemon.ledger import PageLedger, parents_first
from memory_daemon.prefix import Published, page_keys
from memory_daemon.prefix_events import DISK, POOL, Cleared, Stored
from memory_daemon.shape import PoolShape
from memory_daemon.tiers import PoolTier, ShmPageCopier
from pagedserve.plumbing.errors import PermissionDenied

OWNER = fingerprint("model-a", "shape")
PAYLOAD = bytes(range(256)) * 8


def inline(folder: Path, capacity_bytes: int) -> DiskTier:
    """A tier that writes each page as it is put, so that what is on disk is known at every line."""
    return DiskTier(folder, capacity_bytes, background=False)


def page(key: bytes, payload: bytes = PAYLOAD) -> StoredPage:
    return StoredPage(key, b"parent-" + key, (1, 2, 3, 4), payload)


def files(tier: DiskTier) -> list[Path]:
    return sorted(tier.folder.path.glob("*.kvpage"))


def test_a_page_comes_back_whole_and_the_budget_holds_the_most_recent(tmp_path: Path) -> None:
    size = len(PAYLOAD) + 200  # a page's file: the payload and its header
    tier = inline(tmp_path / "tier", 3 * size)
    assert oct(tier.folder.path.stat().st_mode & 0o777) == "0o700"
    for key in (b"k1", b"k2", b"k3"):
        assert tier.put(OWNER, page(key))
    assert not tier.put(OWNER, page(b"k1"))  # kept already, and now the most recent
    assert tier.get(OWNER, b"k2") == page(b"k2")  # read: now the most recent
    assert tier.put(OWNER, page(b"k4"))  # over the budget: k3, the least recent, goes
    assert [tier.has(OWNER, key) for key in (b"k1", b"k2", b"k3", b"k4")] == [True, True, False, True]
    assert tier.get(fingerprint("model-b", "shape"), b"k1") is None  # another model's key is not ours
    assert tier.get(fingerprint("model-a", "other shape"), b"k1") is None
    counts = tier.counts()
    assert (counts.pages, counts.demotions, counts.dropped) == (3, 4, 1)
    assert counts.promotions == 0 and counts.bytes_read == counts.bytes // 3  # read, installed in no pool
    assert counts.bytes == sum(path.stat().st_size for path in files(tier)) <= counts.capacity_bytes
    assert all(oct(path.stat().st_mode & 0o777) == "0o600" for path in files(tier))


def test_a_restarted_tier_serves_what_the_last_left(tmp_path: Path) -> None:
    first = inline(tmp_path, 1 << 20)
    first.put(OWNER, page(b"k1"))
    first.put(OWNER, page(b"k2", PAYLOAD[::-1]))
    (tmp_path / ".x.kvpage.1.ab.partial").write_bytes(b"half a page")  # a write a crash cut short

    second = inline(tmp_path, 1 << 20)
    assert second.counts().pages == 2 and second.counts().rejected == 0
    assert second.get(OWNER, b"k2") == page(b"k2", PAYLOAD[::-1])
    assert not list(tmp_path.glob("*.partial"))
    assert inline(tmp_path, 1000).counts().pages == 0  # a smaller budget drops what no longer fits


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def damage_open_to_others(path: Path) -> None:
    path.chmod(0o644)


def damage_link(path: Path) -> None:
    os.link(path, path.with_name("second-name"))


def file_of(tier: DiskTier, key: bytes) -> Path:
    """The file that holds key's page (its header names the parent, b"parent-" + key)."""
    (path,) = [path for path in files(tier) if b"parent-" + key in path.read_bytes()]
    return path


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip, damage_open_to_others, damage_link])
@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
def test_a_damaged_file_is_deleted_unread(
    tmp_path: Path, damage: Callable[[Path], None], restart: bool
) -> None:
    tier = inline(tmp_path, 1 << 20)
    tier.put(OWNER, page(b"k1"))
    tier.put(OWNER, page(b"k2", PAYLOAD[::-1]))
    path = file_of(tier, b"k1")
    damage(path)
    if restart:
        tier = inline(tmp_path, 1 << 20)
    assert tier.get(OWNER, b"k1") is None
    assert tier.get(OWNER, b"k2") == page(b"k2", PAYLOAD[::-1])
    assert tier.counts().rejected == 1 and tier.counts().pages == 1
    assert not path.exists()


def test_a_symlink_or_a_file_under_another_pages_name_is_refused(tmp_path: Path) -> None:
    tier = inline(tmp_path / "tier", 1 << 20)
    tier.put(OWNER, page(b"k1"))
    tier.put(OWNER, page(b"k2", PAYLOAD[::-1]))
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a page")
    planted = file_of(tier, b"k2")
    planted.unlink()
    os.symlink(secret, planted)  # a symlink where k2's page was

    assert tier.get(OWNER, b"k2") is None and tier.counts().rejected == 1
    assert secret.read_bytes() == b"not a page" and not planted.is_symlink()
    renamed = file_of(tier, b"k1").rename(tier.folder.path / ("0" * 40 + ".kvpage"))  # not its own name
    restarted = inline(tier.folder.path, 1 << 20)
    assert restarted.counts().rejected == 1 and restarted.counts().pages == 0
    assert not renamed.exists()


@pytest.mark.parametrize(
    ("owner", "key"), [(OWNER, b"k2"), (fingerprint("model-b", "shape"), b"k1")], ids=["key", "model"]
)
def test_another_pages_file_under_a_pages_name_is_refused(tmp_path: Path, owner: bytes, key: bytes) -> None:
    """Of the same size, mode and link count: only its header says it is another page (another key's, or
    another model's), and serving it would hand a sequence the wrong KV."""
    tier = inline(tmp_path, 1 << 20)
    tier.put(OWNER, page(b"k1"))
    tier.put(owner, page(key, PAYLOAD[::-1]))
    (ours,) = [path for path in files(tier) if PAYLOAD in path.read_bytes()]
    (theirs,) = [path for path in files(tier) if path != ours]
    os.replace(theirs, ours)
    assert tier.get(OWNER, b"k1") is None
    assert tier.counts().rejected == 1 and not ours.exists()


def test_a_folder_others_can_enter_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(PermissionDenied, match="open to others"):
        inline(folder, 1 << 20)


SHAPE = PoolShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4)


def test_the_ledger_demotes_on_eviction_and_promotes_on_a_lookup(tmp_path: Path) -> None:
    """A pool of 4 usable pages: a prefix of two pages published and left idle, then evicted by a lease
    that takes every page; the pages' bytes go to disk, and a lookup brings them back into free pages, with
    their bytes, indexed again (the books balance throughout)."""
    pages = 5
    memory = mmap.mmap(-1, pages * SHAPE.page_bytes)
    copier = ShmPageCopier(memory, SHAPE, pages)
    disk = inline(tmp_path, 1 << 20)
    ledger = PageLedger(pages, tier=PoolTier(None, disk, copier, SHAPE))
    writer, reader = ledger.open_lease("writer", "m"), ledger.open_lease("reader", "m")
    tokens = list(range(8))
    keys = page_keys(tokens, SHAPE.page_size)
    first = ledger.grant(writer, 2)
    assert first is not None
    contents = [bytes([page]) * SHAPE.page_bytes for page in (11, 22)]
    for held, data in zip(first, contents, strict=True):
        copier.write(held, data)
    ledger.update(
        writer, publish=[Published(key, held, b"", ()) for key, held in zip(keys, first, strict=True)]
    )
    ledger.update(writer, unref=first)
    ledger.check_invariants()

    taken = ledger.grant(reader, 4)  # every page: the two cached ones are evicted, and demoted
    assert taken is not None and len(taken) == 4
    assert disk.counts().demotions == 2 and ledger.index.cached_pages == 0
    assert ledger.lookup(reader, keys) == []  # no page to promote into while the pool is full
    ledger.update(reader, release=taken[:2])

    found = ledger.lookup(reader, keys)
    assert len(found) == 2 and [copier.read(page) for page in found] == contents
    assert disk.counts().promotions == 2 and ledger.index.cached_pages == 2
    assert {usage.name for usage in ledger.counts().publishers} == {"writer"}  # the copies' publisher
    ledger.check_invariants()

    ledger.update(reader, unref=found)
    assert ledger.flush("m") == 2 and disk.counts().pages == 0  # a flush empties both tiers
    ledger.check_invariants()


def test_the_index_events_name_the_medium_a_page_enters_and_leaves(tmp_path: Path) -> None:
    """A page the pool evicts leaves the pool and is stored on disk; one promoted back is stored in the pool
    again and stays on disk; one the tier lets go (for room) leaves the disk. A new watcher's whole state
    holds each page in each medium it is in."""
    pages = 4  # three usable
    memory = mmap.mmap(-1, pages * SHAPE.page_bytes)
    page_file = SHAPE.page_bytes + 200
    disk = inline(tmp_path, 2 * page_file)  # room for two pages' files
    ledger = PageLedger(pages, tier=PoolTier(None, disk, ShmPageCopier(memory, SHAPE, pages), SHAPE))
    lease = ledger.open_lease("w", "m")
    tokens = list(range(12))
    keys = page_keys(tokens, SHAPE.page_size)
    events = ledger.index.events_of("m")
    watcher = events.subscribe(0)

    def changes() -> list[tuple[str, int, str]]:
        """The batches so far, as (what, page of the chain, medium)."""
        seen = []
        while not watcher._queue.empty():
            for change in watcher._queue.get_nowait().changes:  # type: ignore[union-attr]
                if not isinstance(change, Cleared):
                    seen.append((type(change).__name__, keys.index(change.key), change.medium))
        return seen

    held = ledger.grant(lease, 3)
    assert held is not None
    parents = [b"", *keys[:-1]]
    ledger.update(lease, publish=[Published(k, p, parents[i], tuple(tokens[4 * i : 4 * i + 4]))
                                  for i, (k, p) in enumerate(zip(keys, held, strict=True))])  # fmt: skip
    ledger.update(lease, unref=held)
    assert changes() == [("Stored", 0, POOL), ("Stored", 1, POOL), ("Stored", 2, POOL)]
    taken = ledger.grant(lease, 2)  # evicts pages 0 and 1: onto the disk
    assert taken is not None
    assert changes() == [("Removed", 0, POOL), ("Removed", 1, POOL), ("Stored", 0, DISK), ("Stored", 1, DISK)]
    ledger.update(lease, release=taken)
    assert ledger.lookup(lease, keys[:1]) != []  # promoted: in the pool again, and still on disk
    assert changes() == [("Stored", 0, POOL)]
    ledger.grant(lease, 2)  # evicts page 2 (the oldest idle), whose file pushes page 1's off the disk
    assert changes() == [("Removed", 2, POOL), ("Removed", 1, DISK), ("Stored", 2, DISK)]
    (snapshot,) = events.snapshot()
    state = [(keys.index(c.key), c.medium) for c in snapshot.changes if isinstance(c, Stored)]
    assert sorted(state) == [(0, DISK), (0, POOL), (2, DISK)]
    ledger.check_invariants()

    # A restarted daemon announces what its tier kept, with each page's parent and tokens, before anything.
    again = PageLedger(
        pages,
        tier=PoolTier(None, inline(tmp_path, 2 * page_file), ShmPageCopier(memory, SHAPE, pages), SHAPE),
    )
    (snapshot,) = again.events_of("m").snapshot()
    kept = [c for c in snapshot.changes if isinstance(c, Stored)]
    assert [(keys.index(c.key), c.medium, c.parent, c.token_ids) for c in kept] == [
        (0, DISK, b"", (0, 1, 2, 3)),
        (2, DISK, keys[1], (8, 9, 10, 11)),
    ]


def test_a_file_deleted_behind_the_tiers_back_leaves_the_index_once_a_read_misses_it(tmp_path: Path) -> None:
    """An operator's cleanup of the folder: the lookup finds nothing, and the index no longer says the pages
    are on disk, nor does DropPublished count them (the tier forgot the files' sizes and not their pages)."""
    pages = 5
    disk = inline(tmp_path, 1 << 20)
    copier = ShmPageCopier(mmap.mmap(-1, pages * SHAPE.page_bytes), SHAPE, pages)
    ledger = PageLedger(pages, tier=PoolTier(None, disk, copier, SHAPE))
    lease = ledger.open_lease("w", "m")
    tokens = list(range(8))
    keys = page_keys(tokens, SHAPE.page_size)
    held = ledger.grant(lease, 2)
    assert held is not None
    parents = [b"", keys[0]]
    ledger.update(lease, publish=[Published(keys[i], held[i], parents[i], tuple(tokens[4 * i : 4 * i + 4]))
                                  for i in range(2)])  # fmt: skip
    ledger.update(lease, unref=held)
    taken = ledger.grant(lease, 4)  # evicts both onto the disk
    assert taken is not None and disk.counts().pages == 2
    ledger.update(lease, release=taken)
    for path in files(disk):
        path.unlink()
    assert ledger.lookup(lease, keys) == []
    (snapshot,) = ledger.events_of("m").snapshot()
    assert [(keys.index(c.key), c.medium) for c in snapshot.changes if isinstance(c, Stored)] == [(1, DISK)]
    assert ledger.drop_published(name="w") == 1  # the second page's file, which no read has missed yet
    ledger.check_invariants()


def test_a_restarted_ledger_announces_its_tiers_pages_parents_first(tmp_path: Path) -> None:
    """A restart indexes the files oldest first, and a child's file may be older than its parent's (the
    parent was evicted later): the events still announce the parent before its child."""
    keys = page_keys(list(range(8)), SHAPE.page_size)
    owner, disk = fingerprint("m", SHAPE), inline(tmp_path, 1 << 20)
    for second, (key, parent) in enumerate([(keys[1], keys[0]), (keys[0], b"")], start=1):  # the child first
        disk.put(owner, StoredPage(key, parent, (1, 2, 3, 4), bytes(SHAPE.page_bytes)))
        os.utime(tmp_path / file_name(owner, key), ns=(second * 10**9, second * 10**9))
    copier = ShmPageCopier(mmap.mmap(-1, 4 * SHAPE.page_bytes), SHAPE, 4)
    again = PageLedger(4, tier=PoolTier(None, inline(tmp_path, 1 << 20), copier, SHAPE))
    (snapshot,) = again.events_of("m").snapshot()
    assert [keys.index(c.key) for c in snapshot.changes if isinstance(c, Stored)] == [0, 1]


def test_a_prefetch_stops_the_chain_before_a_damaged_page(tmp_path: Path) -> None:
    """A prefetch reads the chain's files off the event loop: one that fails its checks is refused, and the
    pages after it are not installed either, since no lookup can reach them past the gap."""
    keys = page_keys(list(range(12)), SHAPE.page_size)
    owner, disk = fingerprint("m", SHAPE), inline(tmp_path, 1 << 20)
    tier = PoolTier(None, disk, ShmPageCopier(mmap.mmap(-1, 4 * SHAPE.page_bytes), SHAPE, 4), SHAPE)
    for i, key in enumerate(keys):
        disk.put(owner, StoredPage(key, keys[i - 1] if i else b"", (i,), bytes([i]) * SHAPE.page_bytes))
    damage_flip(tmp_path / file_name(owner, keys[1]))
    assert [page.key for page in tier.settle("m", tier.read("m", keys)())] == keys[:1]
    assert disk.counts().rejected == 1 and not disk.has(owner, keys[1]) and disk.has(owner, keys[2])


def test_a_restarts_pages_are_announced_parents_first() -> None:
    def kept(key: bytes, parent: bytes) -> Kept:
        return Kept(OWNER, key, parent, (1,))

    child, parent, root, other = kept(b"c", b"p"), kept(b"p", b"r"), kept(b"r", b""), kept(b"o", b"gone")
    assert parents_first([child, other, parent, root]) == [root, parent, child, other]


def test_the_writer_thread_serves_a_page_before_its_file_and_never_leaves_one_removed(tmp_path: Path) -> None:
    """With the writer in the background, a page put is found at once (from memory until written); one
    discarded while it waits is never written; close writes every page still pending."""
    tier = DiskTier(tmp_path, 1 << 30)
    pages = [page(b"k%d" % i, bytes([i]) * 100_000) for i in range(40)]
    for item in pages:
        assert tier.put(OWNER, item)
    assert all(tier.get(OWNER, item.key) == item for item in pages)
    tier.discard(OWNER, b"k7")
    tier.close()
    assert tier.counts().pages == 39 and len(files(tier)) == 39
    assert tier.counts().demotions in (39, 40) and tier.counts().bytes == sum(
        p.stat().st_size for p in files(tier)
    )
    restarted = inline(tmp_path, 1 << 30)
    assert restarted.get(OWNER, b"k7") is None and restarted.get(OWNER, b"k8") == pages[8]
