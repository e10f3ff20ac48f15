"""The MemoryDaemon contract's messages to and from the daemon's plain dataclasses.

The servicer (`service`) and the worker's client (`services.worker.kv.remote`) are the only callers: below
them, shapes, pool handles and counts are dataclasses.
"""

from __future__ import annotations

from memory_daemon.disk_tier import TierCounts
from memory_daemon.export import CudaHandle, PoolDescriptor, ShmHandle
from memory_daemon.pool import Pool
from memory_daemon.prefix_events import DISK, HOST, POOL, Batch, Removed, Stored
from memory_daemon.shape import DEFAULT_PAGE_SIZE, PoolShape
from memory_daemon.stats import PoolCounts, PublisherUsage, TenantPins, WorkerUsage
from pagedserve.memory.v1 import memory_pb2
from pagedserve.plumbing.messages import from_message, to_message

_MEDIA = {POOL: memory_pb2.MEDIUM_POOL, HOST: memory_pb2.MEDIUM_HOST, DISK: memory_pb2.MEDIUM_DISK}


def shape_to_pb(shape: PoolShape) -> memory_pb2.PoolShape:
    return to_message(shape, memory_pb2.PoolShape)


def shape_from_pb(pb: memory_pb2.PoolShape) -> PoolShape:
    """Raises InvalidArgument for a shape no pool can have."""
    return from_message(PoolShape, pb, page_size=pb.page_size or DEFAULT_PAGE_SIZE)


def descriptor_to_pb(descriptor: PoolDescriptor) -> memory_pb2.PoolDescriptor:
    pb = memory_pb2.PoolDescriptor(
        pool_id=descriptor.pool_id,
        shape=shape_to_pb(descriptor.shape),
        num_pages=descriptor.num_pages,
        nbytes=descriptor.nbytes,
    )
    handle = descriptor.handle
    if isinstance(handle, ShmHandle):
        pb.shm.path = handle.path
    else:
        pb.cuda.CopyFrom(to_message(handle, memory_pb2.CudaIpc))
    return pb


def descriptor_from_pb(pb: memory_pb2.PoolDescriptor) -> PoolDescriptor:
    kind = pb.WhichOneof("storage")
    handle: ShmHandle | CudaHandle
    if kind == "shm":
        handle = ShmHandle(pb.shm.path)
    elif kind == "cuda":
        handle = from_message(CudaHandle, pb.cuda)
    else:
        raise ValueError(f"the daemon sent a pool with no storage this worker knows: {kind!r}")
    return PoolDescriptor(pb.pool_id, shape_from_pb(pb.shape), pb.num_pages, pb.nbytes, handle)


def pool_stats_to_pb(pool: Pool) -> memory_pb2.PoolStats:
    counts = pool.ledger.counts()
    return to_message(
        counts,
        memory_pb2.PoolStats,
        workers=[to_message(usage, memory_pb2.WorkerUsage) for usage in counts.workers],
        publishers=[to_message(usage, memory_pb2.PublisherUsage) for usage in counts.publishers],
        tenants=[to_message(pins, memory_pb2.TenantPins) for pins in counts.tenants],
        pool_id=pool.pool_id,
        shape=shape_to_pb(pool.shape),
        storage=pool.storage.label,
    )


def tier_stats_to_pb(counts: TierCounts) -> memory_pb2.TierStats:
    return to_message(counts, memory_pb2.TierStats)


def tier_counts_from_pb(pb: memory_pb2.TierStats) -> TierCounts:
    return from_message(TierCounts, pb)


def counts_from_pb(pb: memory_pb2.PoolStats) -> PoolCounts:
    return from_message(
        PoolCounts,
        pb,
        workers=tuple(from_message(WorkerUsage, w) for w in pb.workers),
        publishers=tuple(from_message(PublisherUsage, p) for p in pb.publishers),
        tenants=tuple(from_message(TenantPins, t) for t in pb.tenants),
    )


def batch_to_pb(batch: Batch) -> memory_pb2.PrefixIndexBatch:
    pb = memory_pb2.PrefixIndexBatch(sequence=batch.sequence, timestamp=batch.timestamp)
    for change in batch.changes:
        if isinstance(change, Stored):
            stored = memory_pb2.CachedPage(key=change.key, parent=change.parent, token_ids=change.token_ids)
            pb.changes.add(stored=stored, medium=_MEDIA[change.medium])
        elif isinstance(change, Removed):
            pb.changes.add(removed=change.key, medium=_MEDIA[change.medium])
        else:
            pb.changes.add(cleared=True)
    return pb
