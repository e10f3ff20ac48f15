"""The daemon's Prometheus metrics: page counts, prefix cache and evictions per pool.

The ledgers change on the daemon's event loop while prometheus_client serves scrapes from its own thread,
so the scrape thread never touches a ledger. A task on the loop takes a snapshot of every pool's counts
(the numbers GetStats reports) every half second, and the collector reads the latest snapshot: a tuple
replaced whole, so a scrape sees one consistent moment, at most half a second old.

Per pool, labelled `pool` (its id): `pagedserve_kv_pages{state}` for free, leased and shared pages
(free + leased + shared = `pagedserve_kv_pages_total_capacity`, the usable pages) and for cached,
evictable and pinned pages, which are subsets of shared; `pagedserve_kv_workers`, the attached leases; and
counters for evictions, prefix lookups, lookups that hit, pages queried and pages hit, and pages left
unpinned for want of pin budget. Tenants are not labels (a salt names one, so they are unbounded): GetStats
lists each tenant's pinned pages. With `--kv-host-memory` or `--kv-disk`, each tier's pages, bytes and
budget, and counters of its demotions, promotions, bytes moved, the seconds promotions took, and pages
dropped or files rejected (`pagedserve_kv_tier_*{tier="host"}`, `{tier="disk"}`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from memory_daemon.disk_tier import TierCounts
from memory_daemon.service import MemoryDaemonService
from memory_daemon.stats import PoolCounts
from pagedserve.plumbing.metrics import MetricsSettings

SNAPSHOT_INTERVAL_S = 0.5

# (metric name without _total, PoolCounts field, help)
_COUNTERS = (
    ("pagedserve_kv_evictions", "evictions", "cached pages evicted to make room"),
    ("pagedserve_kv_prefix_lookups", "prefix_lookups", "prefix cache lookups"),
    ("pagedserve_kv_prefix_hits", "prefix_hits", "prefix cache lookups that matched at least one page"),
    ("pagedserve_kv_prefix_queried_pages", "prefix_queried_pages", "pages asked for by prefix lookups"),
    ("pagedserve_kv_prefix_hit_pages", "prefix_hit_pages", "pages found by prefix lookups"),
    (
        "pagedserve_kv_pins_refused",
        "pins_refused",
        "pages a pin asked for beyond a tenant's or the pool's budget",
    ),
)
_STATES = ("free", "leased", "shared", "cached", "evictable", "pinned")


# The tiers' (metric name without _total, TierCounts field, help)
_TIER_GAUGES = (
    ("pagedserve_kv_tier_pages", "pages", "pages kept in the tier"),
    ("pagedserve_kv_tier_bytes", "bytes", "bytes the tier's pages take"),
    ("pagedserve_kv_tier_capacity_bytes", "capacity_bytes", "the tier's budget"),
)
_TIER_COUNTERS = (
    ("pagedserve_kv_tier_demotions", "demotions", "evicted pages written to the tier"),
    ("pagedserve_kv_tier_promotions", "promotions", "pages read back into a pool on a prefix hit"),
    ("pagedserve_kv_tier_written_bytes", "bytes_written", "bytes written by demotions"),
    ("pagedserve_kv_tier_read_bytes", "bytes_read", "bytes read by promotions"),
    (
        "pagedserve_kv_tier_promote_seconds",
        "promote_seconds",
        "seconds promotions took to read (or copy) and check",
    ),
    ("pagedserve_kv_tier_dropped", "dropped", "pages the tier let go to stay in its budget"),
    ("pagedserve_kv_tier_rejected", "rejected", "files refused unread: truncated, corrupt, foreign, planted"),
)


class PoolSnapshots(Collector):
    """The latest counts of every pool and of each tier below them, taken on the event loop and read by the
    scrape thread."""

    def __init__(
        self,
        read_counts: Callable[[], list[tuple[int, PoolCounts]]],
        read_tiers: Callable[[], dict[str, TierCounts]] = dict,
    ) -> None:
        self._read_counts = read_counts
        self._read_tiers = read_tiers
        self.latest: tuple[tuple[int, PoolCounts], ...] = ()
        self.latest_tiers: dict[str, TierCounts] = {}

    def refresh(self) -> None:
        self.latest = tuple(self._read_counts())
        self.latest_tiers = self._read_tiers()

    async def run(self, interval_s: float = SNAPSHOT_INTERVAL_S) -> None:
        """Refresh forever (run it as a task on the daemon's loop; cancel it to stop)."""
        while True:
            self.refresh()
            await asyncio.sleep(interval_s)

    def describe(self) -> Iterator[Metric]:
        yield from self._families(())
        yield from self._tier_families({})

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.latest)
        yield from self._tier_families(self.latest_tiers)

    @staticmethod
    def _tier_families(tiers: dict[str, TierCounts]) -> Iterator[Metric]:
        """Labelled tier="host" or "disk"; without a tier, the families and no samples."""
        for kind, table in ((GaugeMetricFamily, _TIER_GAUGES), (CounterMetricFamily, _TIER_COUNTERS)):
            for name, field, text in table:
                family = kind(name, text, labels=["tier"])
                for medium, counts in tiers.items():
                    family.add_metric([medium], getattr(counts, field))
                yield family

    @staticmethod
    def _families(snapshot: tuple[tuple[int, PoolCounts], ...]) -> Iterator[Metric]:
        pages = GaugeMetricFamily(
            "pagedserve_kv_pages",
            "pages by state: free + leased + shared = capacity; cached, evictable, pinned: shared pages",
            labels=["pool", "state"],
        )
        capacity = GaugeMetricFamily(
            "pagedserve_kv_pages_total_capacity", "usable pages (the null page not counted)", labels=["pool"]
        )
        workers = GaugeMetricFamily("pagedserve_kv_workers", "workers attached (leases)", labels=["pool"])
        counters = [CounterMetricFamily(name, text, labels=["pool"]) for name, _, text in _COUNTERS]
        for pool_id, counts in snapshot:
            pool = str(pool_id)
            for state in _STATES:
                pages.add_metric([pool, state], getattr(counts, f"{state}_pages"))
            capacity.add_metric([pool], counts.total_pages)
            workers.add_metric([pool], len(counts.workers))
            for family, (_, field, _) in zip(counters, _COUNTERS, strict=True):
                family.add_metric([pool], getattr(counts, field))
        yield from (pages, capacity, workers, *counters)


def start_metrics(
    service: MemoryDaemonService, settings: MetricsSettings, registry: CollectorRegistry = REGISTRY
) -> asyncio.Task[None]:
    """Snapshot the service's pools on this loop, register the collector and serve /metrics.

    Returns the snapshot task; cancel it at shutdown.
    """
    snapshots = PoolSnapshots(service.pool_counts, service.tier_counts)
    registry.register(snapshots)
    task = asyncio.create_task(snapshots.run(), name="metrics-snapshots")
    settings.serve()
    return task
