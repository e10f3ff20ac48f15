"""Pool statistics as plain dataclasses, converted to and from protobuf at the service boundary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from pagedserve.memory.v1 import memory_pb2


@dataclass(frozen=True)
class WorkerUsage:
    worker_id: int
    name: str
    model_id: str
    leased_pages: int
    idle_pages: int
    referenced_pages: int
    refill_pages: int


@dataclass(frozen=True)
class PoolCounts:
    """Page counts of one pool. Invariant: total = free + leased + shared; cached <= shared."""

    total_pages: int
    free_pages: int
    leased_pages: int
    shared_pages: int
    cached_pages: int
    evictable_pages: int
    evictions: int
    prefix_lookups: int
    prefix_hits: int
    prefix_queried_pages: int
    prefix_hit_pages: int
    workers: tuple[WorkerUsage, ...] = ()

    @property
    def settled(self) -> bool:
        """Every page is free or cached: nothing leased, nothing referenced."""
        return self.leased_pages == 0 and self.free_pages + self.evictable_pages == self.total_pages

    def to_pb(self, **extra: object) -> memory_pb2.PoolStats:
        scalars = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "workers"}
        workers = [memory_pb2.WorkerUsage(**asdict(w)) for w in self.workers]
        return memory_pb2.PoolStats(**scalars, workers=workers, **extra)

    @classmethod
    def from_pb(cls, pb: memory_pb2.PoolStats) -> PoolCounts:
        scalars = {f.name: getattr(pb, f.name) for f in fields(cls) if f.name != "workers"}
        workers = tuple(
            WorkerUsage(**{f.name: getattr(w, f.name) for f in fields(WorkerUsage)}) for w in pb.workers
        )
        return cls(**scalars, workers=workers)
