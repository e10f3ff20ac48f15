"""One pool: its shape, its memory, and the ledger that accounts for its pages."""

from __future__ import annotations

from dataclasses import dataclass, field

from memory_daemon.export import Storage
from memory_daemon.ledger import PageLedger
from memory_daemon.shape import PoolShape
from pagedserve.memory.v1 import memory_pb2


@dataclass(eq=False)
class Pool:
    pool_id: int
    shape: PoolShape
    storage: Storage
    ledger: PageLedger
    model_ids: set[str] = field(default_factory=set)

    @property
    def num_pages(self) -> int:
        return self.ledger.num_pages

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.shape.page_bytes

    def descriptor(self) -> memory_pb2.PoolDescriptor:
        descriptor = memory_pb2.PoolDescriptor(
            pool_id=self.pool_id, shape=self.shape.to_pb(), num_pages=self.num_pages, nbytes=self.nbytes
        )
        self.storage.describe(descriptor)
        return descriptor

    def stats(self) -> memory_pb2.PoolStats:
        return self.ledger.counts().to_pb(
            pool_id=self.pool_id, shape=self.shape.to_pb(), storage=self.storage.label
        )
