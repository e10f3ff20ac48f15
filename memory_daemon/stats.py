"""Pool statistics as plain dataclasses; `wire` converts them to and from protobuf."""

from __future__ import annotations

from dataclasses import dataclass


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
class PublisherUsage:
    """A worker whose published pages are still in the prefix index, attached or gone."""

    worker_id: int
    name: str
    model_id: str
    cached_pages: int


@dataclass(frozen=True)
class TenantPins:
    tenant: str
    pinned_pages: int


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
    publishers: tuple[PublisherUsage, ...] = ()
    pinned_pages: int = 0  # cached pages some tenant pinned (cache_ttl_seconds), none of them evictable
    pin_budget_pages: int = 0  # how many may be pinned in all (--pin-share)
    tenant_pin_budget_pages: int = 0  # how many one tenant may pin (--tenant-pin-share)
    pins_refused: int = 0  # pages a pin asked for beyond a budget, left unpinned
    tenants: tuple[TenantPins, ...] = ()

    @property
    def settled(self) -> bool:
        """Every page is free or cached: nothing leased, nothing referenced."""
        idle = self.free_pages + self.evictable_pages + self.pinned_pages
        return self.leased_pages == 0 and idle == self.total_pages
