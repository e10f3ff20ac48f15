"""The host-memory tier: pages the pools evict, kept in the daemon's own memory up to `--kv-host-memory`.

It sits between a pool and the disk tier. On CUDA its pages are in pinned host memory (page-locked, so the
GPU's copy engine moves them at full bus speed); on a CPU in the daemon's private memory, outside the
/dev/shm that the pools live in (a container's /dev/shm is often small). Nothing of it outlives the daemon:
a warm restart is the disk tier's.

A page is kept whole, under its model's fingerprint and chain key, with its parent and tokens for the
prefix index's events. The tier is inclusive, as the disk's is: a page promoted back into a pool stays
here, so that evicting it again costs nothing. When a page would take the tier past its budget, the least
recently used go first; `put` returns them so that the caller can write them to the disk tier. Only the
daemon's event loop calls it.
"""

from __future__ import annotations

from collections import OrderedDict

from memory_daemon.disk_tier import Kept, StoredPage, TierCounts
from memory_daemon.prefix_events import HOST, Removed, Stored


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._pages: OrderedDict[tuple[bytes, bytes], StoredPage] = OrderedDict()  # least recently used first
        self._bytes = 0
        # owner -> its pages stored and let go since its last `take_changes`, kept only for owners that ask
        self._changes: dict[bytes, list[Stored | Removed]] = {}
        self._counts = dict.fromkeys(("demotions", "promotions", "bytes_written", "bytes_read", "dropped"), 0)
        self._promote_seconds = 0.0

    def counts(self) -> TierCounts:
        return TierCounts(
            capacity_bytes=self.capacity_bytes,
            pages=len(self._pages),
            bytes=self._bytes,
            promote_seconds=self._promote_seconds,
            **self._counts,
        )

    def has(self, owner: bytes, key: bytes) -> bool:
        return (owner, key) in self._pages

    def put(self, owner: bytes, page: StoredPage) -> list[tuple[bytes, StoredPage]]:
        """Keep page for owner; the pages let go to make room for it, least recently used first (for the
        disk tier below). A page larger than the whole budget is not kept, and comes back as let go."""
        size = len(page.payload)
        if (owner, page.key) in self._pages:
            self._pages.move_to_end((owner, page.key))
            return []
        if size > self.capacity_bytes:
            return [(owner, page)]
        let_go: list[tuple[bytes, StoredPage]] = []
        while self._bytes + size > self.capacity_bytes:
            (old_owner, old_key), old = self._pages.popitem(last=False)
            self._bytes -= len(old.payload)
            self._note(old_owner, Removed(old_key, HOST))
            self._counts["dropped"] += 1
            let_go.append((old_owner, old))
        self._pages[owner, page.key] = page
        self._bytes += size
        self._note(owner, Stored(page.key, page.parent, page.token_ids, HOST))
        self._counts["demotions"] += 1
        self._counts["bytes_written"] += size
        return let_go

    def get(self, owner: bytes, key: bytes) -> StoredPage | None:
        """The page owner keeps under key (now the most recently used), or None."""
        page = self._pages.get((owner, key))
        if page is not None:
            self._pages.move_to_end((owner, key))
        return page

    def promoted(self, page: StoredPage, seconds: float) -> None:
        """Count a page copied from here into a pool, and the time the copy took."""
        self._counts["promotions"] += 1
        self._counts["bytes_read"] += len(page.payload)
        self._promote_seconds += seconds

    def discard(self, owner: bytes, key: bytes) -> None:
        page = self._pages.pop((owner, key), None)
        if page is not None:
            self._bytes -= len(page.payload)
            self._note(owner, Removed(key, HOST))

    def discard_owner(self, owner: bytes) -> int:
        keys = [key for page_owner, key in self._pages if page_owner == owner]
        for key in keys:
            self.discard(owner, key)
        return len(keys)

    def drain(self) -> list[tuple[bytes, StoredPage]]:
        """Every page, least recently used first, and none kept after (a graceful stop hands them down)."""
        pages = [(owner, page) for (owner, _), page in self._pages.items()]
        self._pages.clear()
        self._bytes = 0
        return pages

    def kept(self, owner: bytes) -> list[Kept]:
        """Every page owner keeps here, least recently used first."""
        return [
            Kept(owner, page.key, page.parent, page.token_ids)
            for (page_owner, _), page in self._pages.items()
            if page_owner == owner
        ]

    def take_changes(self, owner: bytes) -> list[Stored | Removed]:
        """owner's pages stored here and let go (for room, or discarded) since the last call."""
        taken = self._changes.get(owner, [])
        self._changes[owner] = []
        return taken

    def _note(self, owner: bytes, change: Stored | Removed) -> None:
        if owner in self._changes:
            self._changes[owner].append(change)
