"""A pool's view of the tier below it: an evicted page's bytes copied out of the pool (demotion), and a
page found there copied back into a free page of the pool (promotion), before a lookup returns it.

The ledger decides which pages move and when (memory_daemon/ledger.py); this module moves their bytes. A
page spans the pool tensor's [num_layers, 2] blocks (`PoolShape.tensor_shape`), so its bytes on disk are
those blocks in that order. A page demoted is cached, idle and published, so no worker writes it; a page
promoted is free until the ledger indexes it, so no worker reads it half written.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

from memory_daemon.disk_tier import DiskTier, Kept, Located, Read, StoredPage, fingerprint, read_page
from memory_daemon.shape import PoolShape


class PageCopier:
    """Reads and writes whole pages of a pool whose memory the daemon maps."""

    def __init__(self, memory: mmap.mmap, shape: PoolShape, num_pages: int) -> None:
        self._memory = memory
        self._block = shape.page_bytes // (2 * shape.num_layers)  # a page's bytes of one layer's K or V
        self._stride = self._block * num_pages  # from one layer's K (or V) blocks to the next's
        self._blocks = 2 * shape.num_layers

    def read(self, page: int) -> bytes:
        offsets = (i * self._stride + page * self._block for i in range(self._blocks))
        return b"".join(self._memory[at : at + self._block] for at in offsets)

    def write(self, page: int, data: bytes) -> None:
        for i in range(self._blocks):
            at = i * self._stride + page * self._block
            self._memory[at : at + self._block] = data[i * self._block : (i + 1) * self._block]


class PoolTier:
    """What one pool's ledger demotes into and promotes from: the daemon's disk tier, with each page under
    its model's fingerprint for this pool's shape."""

    def __init__(self, disk: DiskTier, copier: PageCopier, shape: PoolShape) -> None:
        self.disk = disk
        self._copier = copier
        self._shape = shape
        self._owners: dict[str, bytes] = {}

    def demote(self, model_id: str, key: bytes, page: int, parent: bytes, token_ids: tuple[int, ...]) -> bool:
        owner = self._owner(model_id)
        if self.disk.has(owner, key):
            return True
        return self.disk.put(owner, StoredPage(key, parent, token_ids, self._copier.read(page)))

    def has(self, model_id: str, key: bytes) -> bool:
        return self.disk.has(self._owner(model_id), key)

    def promote(self, model_id: str, key: bytes, page: int) -> StoredPage | None:
        """Copy the page kept under key into page; None if it is not kept, or failed its checks."""
        stored = self.disk.get(self._owner(model_id), key)
        if stored is None or len(stored.payload) != self._shape.page_bytes:
            return None
        self._copier.write(page, stored.payload)
        self.disk.promoted()
        return stored

    def install(self, page: int, stored: StoredPage) -> None:
        self._copier.write(page, stored.payload)
        self.disk.promoted()

    def read(self, model_id: str, keys: list[bytes]) -> Callable[[], list[Read]]:
        """What reading keys' pages takes: a call that touches no state, for a thread; `settle` its
        results back on the event loop."""
        owner, folder = self._owner(model_id), self.disk.folder
        found: list[tuple[Located | StoredPage, bytes]] = []
        for key in keys:  # the chain, up to a key the tier no longer has
            located = self.disk.locate(owner, key)
            if located is None:
                break
            found.append((located, key))

        def run() -> list[Read]:
            return [
                Read("", located)
                if isinstance(located, StoredPage)
                else read_page(folder, located, owner, key)
                for located, key in found
            ]

        return run

    def settle(self, reads: list[Read]) -> list[StoredPage]:
        """The pages read whole, in chain order, up to the first that is not (the rest cannot be reached
        by a lookup without it); each read accounted for by the disk tier."""
        pages: list[StoredPage] = []
        for page in [self.disk.settle(read) for read in reads]:
            if page is None or len(page.payload) != self._shape.page_bytes:
                break
            pages.append(page)
        return pages

    def forget(self, model_id: str, key: bytes) -> None:
        self.disk.discard(self._owner(model_id), key)

    def flush(self, model_id: str) -> int:
        return self.disk.discard_owner(self._owner(model_id))

    def take_removed(self, model_id: str) -> list[bytes]:
        return self.disk.take_removed(self._owner(model_id))

    def kept(self, model_id: str) -> list[Kept]:
        return self.disk.kept(self._owner(model_id))

    def _owner(self, model_id: str) -> bytes:
        if model_id not in self._owners:
            self._owners[model_id] = fingerprint(model_id, self._shape)
        return self._owners[model_id]
