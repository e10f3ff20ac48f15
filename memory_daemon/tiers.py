"""A pool's view of the tiers below it: an evicted page's bytes copied out of the pool (demotion) into
host memory (`--kv-host-memory`) or else onto disk (`--kv-disk`), and a page found in either copied back
into a free page of the pool (promotion), before a lookup returns it. A page host memory lets go for room
goes on to the disk.

The ledger decides which pages move and when (memory_daemon/ledger.py); this module moves their bytes. A
page spans the pool's [num_layers, 2] blocks (`PoolShape.tensor_shape`), each num_pages blocks apart, so its
bytes in a tier are those blocks in that order: one strided copy, a cudaMemcpy2D on CUDA. A page demoted is
cached, idle and published, so no worker writes it (a worker publishes a page after its step's writes are
done); a page promoted is free until the ledger indexes it, so no worker reads it half written.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import Protocol

from memory_daemon.disk_tier import DiskTier, Kept, Located, Read, StoredPage, fingerprint, read_page
from memory_daemon.host_tier import HostTier
from memory_daemon.prefix_events import DISK, HOST, Removed, Stored
from memory_daemon.shape import PoolShape


class PageCopier(Protocol):
    def read(self, page: int) -> bytes | memoryview:
        """A copy of the page's bytes, in memory of the copier's own."""

    def write(self, page: int, data: bytes | memoryview) -> None: ...


class _Layout:
    """Where a page's blocks are: 2 * num_layers blocks of `block` bytes, `stride` bytes apart."""

    def __init__(self, shape: PoolShape, num_pages: int) -> None:
        self.block = shape.page_bytes // (2 * shape.num_layers)  # a page's bytes of one layer's K or V
        self.stride = self.block * num_pages  # from one layer's K (or V) blocks to the next's
        self.blocks = 2 * shape.num_layers

    def offset(self, page: int) -> int:
        return page * self.block


class ShmPageCopier:
    """Reads and writes whole pages of a CPU pool, which the daemon maps."""

    def __init__(self, memory: mmap.mmap, shape: PoolShape, num_pages: int) -> None:
        self._memory = memory
        self._layout = _Layout(shape, num_pages)

    def read(self, page: int) -> bytes:
        layout = self._layout
        offsets = (i * layout.stride + layout.offset(page) for i in range(layout.blocks))
        return b"".join(self._memory[at : at + layout.block] for at in offsets)

    def write(self, page: int, data: bytes | memoryview) -> None:
        layout = self._layout
        for i in range(layout.blocks):
            at = i * layout.stride + layout.offset(page)
            self._memory[at : at + layout.block] = data[i * layout.block : (i + 1) * layout.block]


class CudaPageCopier:
    """Reads and writes whole pages of a CUDA pool through one cudaMemcpy2D each way: a page read lands in
    pinned host memory of its own (the host tier keeps it there)."""

    def __init__(self, device_index: int, base: int, shape: PoolShape, num_pages: int) -> None:
        self._device_index = device_index
        self._base = base
        self._layout = _Layout(shape, num_pages)
        self._nbytes = shape.page_bytes

    def read(self, page: int) -> memoryview:
        import cupy
        import numpy

        layout = self._layout
        pinned = numpy.frombuffer(cupy.cuda.alloc_pinned_memory(self._nbytes), numpy.uint8, self._nbytes)
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(self._device_index):
            runtime.memcpy2D(
                *(pinned.ctypes.data, layout.block, self._base + layout.offset(page), layout.stride),
                *(layout.block, layout.blocks, runtime.memcpyDeviceToHost),
            )
        return memoryview(pinned)  # type: ignore[arg-type]  # keeps the pinned allocation alive

    def write(self, page: int, data: bytes | memoryview) -> None:
        import cupy
        import numpy

        layout = self._layout
        host = numpy.frombuffer(data, numpy.uint8, self._nbytes)
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(self._device_index):
            runtime.memcpy2D(
                *(self._base + layout.offset(page), layout.stride, host.ctypes.data, layout.block),
                *(layout.block, layout.blocks, runtime.memcpyHostToDevice),
            )
            # From pageable memory (a page read from disk) cudaMemcpy may return before the DMA is done;
            # the page goes to a worker's stream in another process, which nothing orders after it.
            runtime.deviceSynchronize()


class LowerTier(Protocol):
    """Where a ledger's evicted pages go and hits come back from (PoolTier, below)."""

    def demote(self, model_id: str, key: bytes, page: int, parent: bytes, token_ids: tuple[int, ...]) -> bool:
        """Keep the page's bytes under key; whether the tier holds it now."""

    def has(self, model_id: str, key: bytes) -> bool: ...

    def promote(self, model_id: str, key: bytes, page: int) -> StoredPage | None:
        """Copy the page kept under key into page; what it is, or None if the tier has it no more."""

    def persist(
        self, model_id: str, key: bytes, page: int, parent: bytes, token_ids: tuple[int, ...]
    ) -> bool:
        """Keep the page's bytes where the next daemon finds them (the disk); whether they are there."""

    def install(self, model_id: str, page: int, stored: StoredPage) -> None:
        """Copy a page read from the tier (a prefetch's) into page."""

    def forget(self, model_id: str, key: bytes) -> None: ...

    def flush(self, model_id: str) -> int: ...

    def take_changes(self, model_id: str) -> list[Stored | Removed]:
        """model_id's pages the tier stored and let go since the last call (for the index's events)."""

    def kept(self, model_id: str) -> dict[str, list[Kept]]:
        """Every page of model_id's the tier keeps (a restarted daemon's, too), least recently used first,
        by medium."""


class PoolTier:
    """What one pool's ledger demotes into and promotes from: the daemon's host-memory tier and disk tier
    (either or both), with each page under its model's fingerprint for this pool's shape."""

    def __init__(
        self, host: HostTier | None, disk: DiskTier | None, copier: PageCopier, shape: PoolShape
    ) -> None:
        assert host is not None or disk is not None, "a pool tier has host memory, a disk, or both"
        self.host = host
        self.disk = disk
        self._copier = copier
        self._shape = shape
        self._owners: dict[str, bytes] = {}

    def demote(self, model_id: str, key: bytes, page: int, parent: bytes, token_ids: tuple[int, ...]) -> bool:
        """Copy the page into host memory if there is a host tier, else onto disk; whether a tier holds it."""
        owner = self._owner(model_id)
        if self.host is None:
            return self.persist(model_id, key, page, parent, token_ids)
        if self.host.get(owner, key) is not None:
            return True
        let_go = self.host.put(owner, StoredPage(key, parent, token_ids, self._copier.read(page)))
        for let_go_owner, stored in let_go:  # the least recently used, for room: on to the disk
            if self.disk is not None and not self.disk.has(let_go_owner, stored.key):
                self.disk.put(let_go_owner, stored)
        return self.has(model_id, key)

    def persist(
        self, model_id: str, key: bytes, page: int, parent: bytes, token_ids: tuple[int, ...]
    ) -> bool:
        """Copy the page onto disk (a graceful stop's: host memory goes with the daemon)."""
        owner = self._owner(model_id)
        if self.disk is None:
            return False
        if self.disk.has(owner, key):
            return True
        return self.disk.put(owner, StoredPage(key, parent, token_ids, self._copier.read(page)))

    def has(self, model_id: str, key: bytes) -> bool:
        owner = self._owner(model_id)
        return any(tier is not None and tier.has(owner, key) for tier in (self.host, self.disk))

    def promote(self, model_id: str, key: bytes, page: int) -> StoredPage | None:
        """Copy the page kept under key into page, from host memory first; None if no tier keeps it, or it
        failed the disk's checks."""
        owner = self._owner(model_id)
        stored = self.host.get(owner, key) if self.host is not None else None
        if stored is None and self.disk is not None:
            stored = self.disk.get(owner, key)
        if stored is None or len(stored.payload) != self._shape.page_bytes:
            return None
        self.install(model_id, page, stored)
        return stored

    def install(self, model_id: str, page: int, stored: StoredPage) -> None:
        """Copy a page found in a tier into page, counted as that tier's promotion."""
        started = time.perf_counter()
        self._copier.write(page, stored.payload)
        owner = self._owner(model_id)
        if self.host is not None and self.host.has(owner, stored.key):
            self.host.promoted(stored, time.perf_counter() - started)
        elif self.disk is not None:
            self.disk.promoted()

    def read(self, model_id: str, keys: list[bytes]) -> Callable[[], list[Read]]:
        """What reading keys' pages takes: a call that touches no state, for a thread; `settle` its
        results back on the event loop. Pages in host memory (or waiting for the disk's writer) need no
        read."""
        owner = self._owner(model_id)
        found: list[tuple[Located | StoredPage, bytes]] = []
        for key in keys:  # the chain, up to a key no tier has
            located: Located | StoredPage | None = None
            if self.host is not None:
                located = self.host.get(owner, key)
            if located is None and self.disk is not None:
                located = self.disk.locate(owner, key)
            if located is None:
                break
            found.append((located, key))
        folder = self.disk.folder if self.disk is not None else None

        def run() -> list[Read]:
            return [
                Read("", located)
                if isinstance(located, StoredPage)
                else read_page(folder, located, owner, key)  # type: ignore[arg-type]  # a disk's
                for located, key in found
            ]

        return run

    def settle(self, model_id: str, reads: list[Read]) -> list[StoredPage]:
        """The pages read whole, in chain order, up to the first that is not, or that no tier keeps any
        more (flushed or forgotten while the read ran: it must not come back); each file read accounted
        for by the disk tier."""
        pages: list[StoredPage] = []
        for read in reads:
            page = read.page if not read.name or self.disk is None else self.disk.settle(read)
            if page is None or len(page.payload) != self._shape.page_bytes:
                break
            if not self.has(model_id, page.key):
                break
            pages.append(page)
        return pages

    def forget(self, model_id: str, key: bytes) -> None:
        owner = self._owner(model_id)
        if self.host is not None:
            self.host.discard(owner, key)
        if self.disk is not None:
            self.disk.discard(owner, key)

    def flush(self, model_id: str) -> int:
        owner = self._owner(model_id)
        return sum(tier.discard_owner(owner) for tier in (self.host, self.disk) if tier is not None)

    def take_changes(self, model_id: str) -> list[Stored | Removed]:
        """model_id's pages stored in a tier and let go from one since the last call (for the events)."""
        owner = self._owner(model_id)
        return [
            change
            for tier in (self.host, self.disk)
            if tier is not None
            for change in tier.take_changes(owner)
        ]

    def kept(self, model_id: str) -> dict[str, list[Kept]]:
        """Every page of model_id's each tier keeps (a restarted daemon's on disk, too), least recently used
        first, by medium."""
        owner = self._owner(model_id)
        media = ((HOST, self.host), (DISK, self.disk))
        return {medium: tier.kept(owner) for medium, tier in media if tier is not None}

    def _owner(self, model_id: str) -> bytes:
        if model_id not in self._owners:
            self._owners[model_id] = fingerprint(model_id, self._shape)
        return self._owners[model_id]
