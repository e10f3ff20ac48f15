"""A worker's lease on a pool, and the states a page can be in."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum

from memory_daemon.refill import RefillPolicy
from memory_daemon.stats import WorkerUsage

NULL_PAGE = 0


class PageState(IntEnum):
    FREE = 0
    LEASED = 1
    SHARED = 2
    NULL = 3


@dataclass(eq=False)
class Lease:
    lease_id: str
    worker_id: int
    name: str
    model_id: str
    refill: RefillPolicy
    pages: set[int] = field(default_factory=set)  # LEASED pages
    refs: Counter[int] = field(default_factory=Counter)  # SHARED page -> references held
    idle: int = 0  # pages on the worker's local free list, as last reported

    def __str__(self) -> str:
        return f"worker {self.name!r} (id {self.worker_id})"

    def usage(self) -> WorkerUsage:
        return WorkerUsage(
            worker_id=self.worker_id,
            name=self.name,
            model_id=self.model_id,
            leased_pages=len(self.pages),
            idle_pages=self.idle,
            referenced_pages=len(self.refs),
            refill_pages=self.refill.pages,
        )
