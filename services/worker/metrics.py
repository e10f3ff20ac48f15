"""The worker's Prometheus metrics: its engine's load, KV use, token counts and step times.

The engine runs in its own thread and prometheus_client scrapes from another, so the collector reads only
what is safe to read across threads: plain int attributes of the core and its scheduler, `EngineLoop.load()`
and `KVCache.usage()` (both take their own locks), and `EngineLoop.kv_slots`, a tuple the engine thread
replaces after every step rather than the running sequences themselves. Step time and tokens per step go
into two histograms through the loop's `on_step` hook, one observation each per forward pass.

Token counters: a request's prompt tokens, and those of them found in the prefix cache, are counted the
first time it is scheduled (so cached / prompt is the prefix cache's hit rate over admitted prompts, and a
recompute after preemption is not counted again); every sampled token counts as a generation token, those
of cancelled requests included. KV fragmentation is 1 - slots_used / slots_allocated.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from services.worker.core.loop import EngineLoop

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_TOKENS_BUCKETS = tuple(float(2**i) for i in range(14))  # 1 .. 8192


class EngineCollector(Collector):
    """Gauges and counters read from an engine at scrape time."""

    def __init__(self, engine: EngineLoop) -> None:
        self._engine = engine

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._engine)

    @staticmethod
    def _families(engine: EngineLoop | None) -> Iterator[Metric]:
        gauges = {
            "running": ("pagedserve_worker_requests_running", "requests running in the engine"),
            "waiting": ("pagedserve_worker_requests_waiting", "requests queued in the engine"),
            "pages": ("pagedserve_worker_kv_pages_in_use", "KV pages held by sequences (own and shared)"),
            "allocated": (
                "pagedserve_worker_kv_slots_allocated",
                "token slots in the pages of running sequences",
            ),
            "used": ("pagedserve_worker_kv_slots_used", "token slots of running sequences holding KV"),
        }
        counters = {
            "preemptions": ("pagedserve_worker_preemptions", "sequences preempted for recompute"),
            "prompt": ("pagedserve_worker_prompt_tokens", "prompt tokens, counted when first scheduled"),
            "cached": (
                "pagedserve_worker_cached_prompt_tokens",
                "prompt tokens found in the prefix cache, counted when first scheduled",
            ),
            "generation": ("pagedserve_worker_generation_tokens", "tokens sampled"),
            "steps": ("pagedserve_worker_engine_steps", "engine steps that ran the model"),
        }
        if engine is None:
            values: dict[str, int] = {}
        else:
            core, scheduler = engine.core, engine.core.scheduler
            running, waiting = engine.load()
            usage = core.kv.usage()
            allocated, used = engine.kv_slots
            values = {
                "running": running,
                "waiting": waiting,
                "pages": usage.in_use_pages + usage.referenced_pages,
                "allocated": allocated,
                "used": used,
                "preemptions": scheduler.preemptions,
                "prompt": scheduler.prompt_tokens,
                "cached": scheduler.cached_prompt_tokens,
                "generation": core.generation_tokens,
                "steps": core.steps,
            }
        for key, (name, text) in gauges.items():
            yield GaugeMetricFamily(name, text, value=values.get(key))
        for key, (name, text) in counters.items():
            yield CounterMetricFamily(name, text, value=values.get(key))


def instrument(engine: EngineLoop, registry: CollectorRegistry = REGISTRY) -> None:
    """Register the engine's collector and step histograms on registry; call before the engine starts."""
    step_seconds = Histogram(
        "pagedserve_worker_step_seconds",
        "duration of an engine step that ran the model: schedule, forward, sample",
        buckets=STEP_SECONDS_BUCKETS,
        registry=registry,
    )
    batch_tokens = Histogram(
        "pagedserve_worker_batch_tokens",
        "tokens per engine step: prefill chunks and decodes",
        buckets=BATCH_TOKENS_BUCKETS,
        registry=registry,
    )

    def on_step(seconds: float, tokens: int) -> None:
        step_seconds.observe(seconds)
        batch_tokens.observe(tokens)

    engine.on_step = on_step
    registry.register(EngineCollector(engine))
