"""One pool: its shape, its memory, and the ledger that accounts for its pages."""

from __future__ import annotations

from dataclasses import dataclass, field

from memory_daemon.export import PoolDescriptor, Storage
from memory_daemon.ledger import PageLedger
from memory_daemon.shape import PoolShape
from memory_daemon.tiers import PoolTier


@dataclass(eq=False)
class Pool:
    pool_id: int
    shape: PoolShape
    storage: Storage
    ledger: PageLedger
    tier: PoolTier | None = None  # the disk tier, seen through this pool's memory (also the ledger's)
    model_ids: set[str] = field(default_factory=set)

    @property
    def num_pages(self) -> int:
        return self.ledger.num_pages

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.shape.page_bytes

    def descriptor(self) -> PoolDescriptor:
        return PoolDescriptor(self.pool_id, self.shape, self.num_pages, self.nbytes, self.storage.handle)
