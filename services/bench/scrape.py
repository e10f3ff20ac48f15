"""KV fragmentation, prefix hits and preemptions, read from the workers' Prometheus metrics during a run.

Fragmentation is sampled while the load runs: the slots allocated to running sequences that hold no token,
over all slots allocated to them (the waste PagedAttention bounds to less than a page per sequence), taken
from every worker and averaged over the samples in which anything was allocated. Counters are read before
and after, so a run's figures do not include earlier runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = (
    "pagedserve_worker_preemptions_total",
    "pagedserve_worker_prompt_tokens_total",
    "pagedserve_worker_cached_prompt_tokens_total",
)
SLOTS = ("pagedserve_worker_kv_slots_allocated", "pagedserve_worker_kv_slots_used")


def scrape(urls: Sequence[str]) -> dict[str, float]:
    """Every sample of every endpoint, summed by name over endpoints and labels."""
    totals: dict[str, float] = defaultdict(float)
    for url in urls:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] += sample.value
    return totals


class KvSampler:
    """Samples the workers' slot gauges while a run lasts, and diffs their counters across it."""

    def __init__(self, urls: Sequence[str], period_s: float = 0.25) -> None:
        self.urls = list(urls)
        self.period_s = period_s
        self._fragmentation: list[float] = []
        self._before: dict[str, float] = {}
        self._after: dict[str, float] = {}

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        if not self.urls:
            yield
            return
        self._before = await asyncio.to_thread(scrape, self.urls)
        task = asyncio.create_task(self._sample())
        try:
            yield
        finally:
            task.cancel()
            self._after = await asyncio.to_thread(scrape, self.urls)

    def summary(self) -> dict[str, float | None] | None:
        if not self.urls:
            return None
        delta = {name: self._after.get(name, 0.0) - self._before.get(name, 0.0) for name in COUNTERS}
        prompt = delta["pagedserve_worker_prompt_tokens_total"]
        samples = self._fragmentation
        return {
            "kv_fragmentation": sum(samples) / len(samples) if samples else None,
            "kv_fragmentation_samples": len(samples),
            "prefix_hit_rate": delta["pagedserve_worker_cached_prompt_tokens_total"] / prompt
            if prompt
            else None,
            "preemptions": delta["pagedserve_worker_preemptions_total"],
        }

    async def _sample(self) -> None:
        while True:
            values = await asyncio.to_thread(scrape, self.urls)
            allocated, used = (values.get(name, 0.0) for name in SLOTS)
            if allocated > 0:
                self._fragmentation.append(1.0 - used / allocated)
            await asyncio.sleep(self.period_s)
