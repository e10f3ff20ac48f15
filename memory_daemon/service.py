"""The MemoryDaemon gRPC servicer: protobuf in, ledger calls, protobuf out.

Every handler runs on one asyncio event loop and the ledger calls are short and synchronous, so there is
no lock and each request sees a consistent pool. A lease lives exactly as long as its Attach stream: the
stream's `finally` returns the lease's pages whether the worker said goodbye or was SIGKILLed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from memory_daemon.config import DaemonConfig
from memory_daemon.disk_tier import DiskTier, TierCounts
from memory_daemon.export import CudaStorage, ShmStorage, Storage
from memory_daemon.host_tier import HostTier
from memory_daemon.lease import Lease as WorkerLease
from memory_daemon.ledger import PageLedger, PinRequest
from memory_daemon.pool import Pool
from memory_daemon.prefix import Published
from memory_daemon.prefix_events import DISK, HOST
from memory_daemon.shape import PoolShape
from memory_daemon.stats import PoolCounts
from memory_daemon.tiers import CudaPageCopier, PageCopier, PoolTier, ShmPageCopier
from memory_daemon.wire import (
    batch_to_pb,
    descriptor_to_pb,
    pool_stats_to_pb,
    shape_from_pb,
    tier_stats_to_pb,
)
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.plumbing.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from pagedserve.plumbing.settings import cuda_index
from pagedserve.plumbing.sizes import format_bytes

log = logging.getLogger(__name__)

SERVICE_NAME = memory_pb2.DESCRIPTOR.services_by_name["MemoryDaemon"].full_name
MAX_PAGES = 2**31 - 1  # page ids travel as uint32
STOPPING = "the memory daemon is shutting down"


class MemoryDaemonService(memory_pb2_grpc.MemoryDaemonServicer):
    def __init__(self, config: DaemonConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._pools: dict[PoolShape, Pool] = {}
        self._shape_by_model: dict[str, PoolShape] = {}
        self._pool_by_lease: dict[str, Pool] = {}
        # Each lease's stream of events; None ends it, at shutdown.
        self._events: dict[str, asyncio.Queue[memory_pb2.AttachEvent | None]] = {}
        self._stopping = False
        self._disk = DiskTier(config.kv_disk, config.kv_disk_bytes) if config.kv_disk else None
        self._host = HostTier(config.kv_host_bytes) if config.kv_host_bytes else None
        # (pool id, model id, key) -> done when a prefetch that is reading it has installed what it read:
        # a lookup for it waits, rather than read the same file again.
        self._prefetching: dict[tuple[int, str, bytes], asyncio.Future[None]] = {}

    async def Attach(
        self, request: memory_pb2.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[memory_pb2.AttachEvent]:
        await self._refuse_if_stopping(context)
        pool = self._pool_for(request)
        lease = pool.ledger.open_lease(request.worker_name or context.peer(), request.model_id)
        pool.model_ids.add(request.model_id)
        self._pool_by_lease[lease.lease_id] = pool
        events: asyncio.Queue[memory_pb2.AttachEvent | None] = asyncio.Queue()
        self._events[lease.lease_id] = events
        log.info("%s attached to pool %d for model %r", lease, pool.pool_id, request.model_id)
        try:
            attached = memory_pb2.Attached(
                lease_id=lease.lease_id,
                worker_id=lease.worker_id,
                pool=descriptor_to_pb(pool.descriptor()),
                refill_pages=lease.refill.pages,
                lower_tier=pool.ledger.tier is not None,
                pin_budget_pages=pool.ledger.pins.budget,
            )
            yield memory_pb2.AttachEvent(attached=attached)
            while (event := await events.get()) is not None:
                yield event
            await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING)
        finally:
            del self._events[lease.lease_id], self._pool_by_lease[lease.lease_id]
            freed, dropped = pool.ledger.close_lease(lease)
            log.info(
                "%s detached: %d leased pages freed, %d references dropped, %d of %d pages free",
                lease,
                freed,
                dropped,
                pool.ledger.free_pages,
                pool.ledger.usable_pages,
            )

    async def Lease(
        self, request: memory_pb2.LeaseRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.LeaseResponse:
        pool, lease = self._find(request.lease_id)
        pages = pool.ledger.refill(lease, request.need, request.consumed, request.idle)
        if pages is None:
            self._ask_for_reclaim(pool, lease, request.need)
            pages = []
        return memory_pb2.LeaseResponse(
            pages=pages, refill_pages=lease.refill.pages, free_pages=pool.ledger.free_pages
        )

    async def Update(
        self, request: memory_pb2.UpdateRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.UpdateResponse:
        pool, lease = self._find(request.lease_id)
        for item in request.publish:
            if len(item.token_ids) > pool.shape.page_size:
                raise InvalidArgument(
                    f"published page {item.page} names {len(item.token_ids)} tokens; a page holds "
                    f"{pool.shape.page_size}"
                )
        pool.ledger.update(
            lease,
            publish=[
                Published(item.key, item.page, item.parent, tuple(item.token_ids)) for item in request.publish
            ],
            pin=[PinRequest(list(pin.keys), pin.ttl_seconds, pin.tenant) for pin in request.pin],
            unref=list(request.unref),
            release=list(request.release),
        )
        pool.ledger.report_idle(lease, request.idle)
        return memory_pb2.UpdateResponse(free_pages=pool.ledger.free_pages)

    async def CheckPins(
        self, request: memory_pb2.CheckPinsRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.CheckPinsResponse:
        pool, lease = self._find(request.lease_id)
        keys = list(request.keys)
        pool.ledger.check_pins(request.tenant, request.pages, pool.pool_id, lease.model_id, keys)
        return memory_pb2.CheckPinsResponse(room=pool.ledger.pins.room(request.tenant))

    async def LookupPrefix(
        self, request: memory_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.LookupResponse:
        pool, lease = self._find(request.lease_id)
        keys = list(request.keys)
        reading = [
            future
            for key in keys[: pool.ledger.usable_pages]
            if (future := self._prefetching.get((pool.pool_id, lease.model_id, key))) is not None
        ]
        if reading:
            await asyncio.wait(reading)
            pool, lease = self._find(request.lease_id)  # the lease may have ended meanwhile
        return memory_pb2.LookupResponse(pages=pool.ledger.lookup(lease, keys))

    async def PrefetchPrefix(
        self, request: memory_pb2.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.PrefetchResponse:
        pool, lease = self._find(request.lease_id)
        ledger, keys = pool.ledger, list(request.keys)
        # What another prefetch is reading already is left to it: the lookup waits for both.
        marks = {
            key: mark
            for key in ledger.promotable(lease.model_id, keys)
            if (mark := (pool.pool_id, lease.model_id, key)) not in self._prefetching
        }
        promoted = 0
        if marks and pool.tier is not None:
            done = asyncio.get_running_loop().create_future()
            for mark in marks.values():
                self._prefetching[mark] = done
            try:
                reads = await asyncio.to_thread(pool.tier.read(lease.model_id, list(marks)))
                promoted = ledger.admit_promoted(lease.model_id, pool.tier.settle(lease.model_id, reads))
            finally:
                for mark in marks.values():
                    del self._prefetching[mark]
                done.set_result(None)
        return memory_pb2.PrefetchResponse(promoted=promoted, cached=ledger.cached_run(lease.model_id, keys))

    async def GetStats(
        self, request: memory_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.DaemonStats:
        if request.check_invariants:
            for pool in self._pools.values():
                pool.ledger.check_invariants()
        disk = None if self._disk is None else tier_stats_to_pb(self._disk.counts())
        host = None if self._host is None else tier_stats_to_pb(self._host.counts())
        return memory_pb2.DaemonStats(
            pools=[pool_stats_to_pb(pool) for pool in self._pools.values()], disk=disk, host=host
        )

    async def DropPublished(
        self, request: memory_pb2.DropPublishedRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.DropPublishedResponse:
        if request.WhichOneof("publisher") is None:
            raise InvalidArgument("name the publisher whose pages to drop: worker_name, or worker_id")
        pools = [pool for pool in self._pools.values() if request.pool_id in (0, pool.pool_id)]
        if request.pool_id and not pools:
            raise NotFound(f"there is no pool {request.pool_id}; GetStats lists the pools")
        if request.WhichOneof("publisher") == "worker_id" and not request.pool_id and len(pools) > 1:
            raise InvalidArgument("worker ids are per pool: name the pool_id too, or use worker_name")
        dropped = sum(
            pool.ledger.drop_published(worker_id=request.worker_id, name=request.worker_name)
            for pool in pools
        )
        who = f"worker id {request.worker_id}" if request.worker_id else f"worker {request.worker_name!r}"
        log.warning("dropped %d cached pages published by %s, on request", dropped, who)
        return memory_pb2.DropPublishedResponse(pages=dropped)

    async def WatchPrefixIndex(
        self, request: memory_pb2.WatchPrefixIndexRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[memory_pb2.PrefixIndexBatch]:
        await self._refuse_if_stopping(context)
        ledger = self._model_pool(request.model_id).ledger
        subscription = ledger.events_of(request.model_id).subscribe(request.after_sequence)
        try:
            while True:
                yield batch_to_pb(await subscription.next())
        finally:
            subscription.close()

    async def FlushPrefixIndex(
        self, request: memory_pb2.FlushPrefixIndexRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.FlushPrefixIndexResponse:
        pages = self._model_pool(request.model_id).ledger.flush(request.model_id)
        log.info("flushed %d idle cached pages of model %r, on request", pages, request.model_id)
        return memory_pb2.FlushPrefixIndexResponse(pages=pages)

    def pool_counts(self) -> list[tuple[int, PoolCounts]]:
        """Every pool's id and counts (call on the daemon's event loop, like any handler)."""
        return [(pool.pool_id, pool.ledger.counts()) for pool in self._pools.values()]

    def tier_counts(self) -> dict[str, TierCounts]:
        """Each tier's counts, by medium (call on the daemon's event loop)."""
        tiers = {HOST: self._host, DISK: self._disk}
        return {medium: tier.counts() for medium, tier in tiers.items() if tier is not None}

    def end_streams(self) -> None:
        """At shutdown: end every lease's stream and index watch, and refuse new ones, with UNAVAILABLE
        saying why. The server's stop would cancel them, which a client reads as "Cancelling all calls" and
        grpc logs as an error of ours, with a traceback."""
        self._stopping = True
        for lease_events in self._events.values():
            lease_events.put_nowait(None)
        for pool in self._pools.values():
            for model_events in pool.ledger.index.events.values():
                model_events.end_subscriptions(Unavailable(STOPPING))

    def close(self) -> None:
        """A graceful stop: the host tier's pages and then the pools' cached pages go to the disk tier, so
        that the next daemon on it serves them; then the pools go. The pools' pages, used last, go last: a
        disk short of room drops its oldest files for them."""
        if self._disk is not None:
            self._disk.close()
            try:
                for owner, page in self._host.drain() if self._host is not None else ():
                    self._disk.put(owner, page)
                for pool in self._pools.values():
                    if pool.ledger.tier is not None:
                        pool.ledger.keep_cached()
            except OSError as exc:  # a full disk, say: what is written is kept, and the pools still go
                log.warning("could not keep every cached page in %s: %s", self._disk.folder.path, exc)
            log.info("kept the pools' cached pages in %s: %s", self._disk.folder.path, self._disk.counts())
        for pool in self._pools.values():
            pool.storage.close()
        self._pools.clear()

    # Internals -------------------------------------------------------------------------------------

    async def _refuse_if_stopping(self, context: grpc.aio.ServicerContext) -> None:
        """A stream opened after `end_streams` would hold the server's stop for its grace."""
        if self._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING)

    def _find(self, lease_id: str) -> tuple[Pool, WorkerLease]:
        pool = self._pool_by_lease.get(lease_id)
        if pool is None:
            raise NotFound(
                f"unknown lease {lease_id!r}: attach first; a lease ends when its Attach stream closes"
            )
        return pool, pool.ledger.leases[lease_id]

    def _model_pool(self, model_id: str) -> Pool:
        shape = self._shape_by_model.get(model_id)
        if shape is None:
            raise NotFound(f"no worker of model {model_id!r} has attached to this daemon yet; start one")
        return self._pools[shape]

    def _pool_for(self, request: memory_pb2.AttachRequest) -> Pool:
        if not request.model_id:
            raise InvalidArgument(
                "model_id is empty: name the model, so that its cached prefixes stay its own"
            )
        if request.device and request.device.split(":")[0] != self._config.device_kind:
            raise FailedPrecondition(
                f"this daemon's pools live on {self._config.device}, which a {request.device} worker cannot "
                f"map; start the daemon with --device {request.device}"
            )
        shape = shape_from_pb(request.shape)
        known = self._shape_by_model.get(request.model_id)
        if known is not None and known != shape:
            raise FailedPrecondition(
                f"model {request.model_id!r} is registered with shape ({known}), "
                f"but this worker has ({shape}); workers of one model must agree on "
                "layers, KV heads, head dim, dtype and page size"
            )
        pool = self._pools.get(shape) or self._create_pool(shape, request)
        self._shape_by_model[request.model_id] = shape
        return pool

    def _create_pool(self, shape: PoolShape, request: memory_pb2.AttachRequest) -> Pool:
        size = request.WhichOneof("size")
        if size == "num_pages":
            num_pages = request.num_pages
        else:
            nbytes = request.memory_bytes if size == "memory_bytes" else self._config.pool_bytes
            num_pages = nbytes // shape.page_bytes
        if not 2 <= num_pages <= MAX_PAGES:
            raise InvalidArgument(
                f"a pool needs 2 to {MAX_PAGES} pages of {format_bytes(shape.page_bytes)} each, "
                f"but this registration gives {num_pages}"
            )
        nbytes = num_pages * shape.page_bytes
        left = self._config.max_memory_bytes - sum(pool.nbytes for pool in self._pools.values())
        if nbytes > left:
            raise ResourceExhausted(
                f"a pool of {num_pages} pages needs {format_bytes(nbytes)}, "
                f"but {format_bytes(max(left, 0))} of the daemon's "
                f"{format_bytes(self._config.max_memory_bytes)} budget is left; "
                "ask for fewer pages or start the daemon with a larger --max-memory"
            )
        pool_id = len(self._pools) + 1
        storage = self._allocate(pool_id, nbytes)
        tier = None
        if self._host is not None or self._disk is not None:
            tier = PoolTier(self._host, self._disk, self._copier(storage, shape, num_pages), shape)
        ledger = PageLedger(
            num_pages,
            low_watermark=int(self._config.watermark * num_pages),
            refill=self._config.refill,
            clock=self._clock,
            tier=tier,
            pin_share=self._config.pin_share,
            tenant_pin_share=self._config.tenant_pin_share,
        )
        pool = Pool(pool_id, shape, storage, ledger, tier)
        self._pools[shape] = pool
        log.info(
            "pool %d: %d pages of %s (%s), %s", pool_id, num_pages, shape, format_bytes(nbytes), storage.label
        )
        return pool

    def _allocate(self, pool_id: int, nbytes: int) -> Storage:
        if self._config.device_kind == "cuda":
            return CudaStorage(cuda_index(self._config.device), nbytes)
        return ShmStorage(Path(self._config.shm_dir), pool_id, nbytes)

    def _copier(self, storage: Storage, shape: PoolShape, num_pages: int) -> PageCopier:
        if isinstance(storage, CudaStorage):
            return CudaPageCopier(cuda_index(self._config.device), storage.ptr, shape, num_pages)
        assert isinstance(storage, ShmStorage)
        return ShmPageCopier(storage.memory, shape, num_pages)

    def _ask_for_reclaim(self, pool: Pool, requester: WorkerLease, need: int) -> None:
        """Ask workers sitting on idle pages to return some, so that the requester can retry."""
        shortfall = need - pool.ledger.free_pages - pool.ledger.index.evictable_pages
        for lease, pages in pool.ledger.reclaim_plan(requester, shortfall):
            self._events[lease.lease_id].put_nowait(
                memory_pb2.AttachEvent(reclaim=memory_pb2.Reclaim(pages=pages))
            )
            log.info("asked %s to return %d idle pages for %s", lease, pages, requester)
