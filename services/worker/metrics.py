"""The worker's Prometheus metrics: its engine's load, KV use, token counts and step times.

The engine runs in its own thread and prometheus_client scrapes from another, so the collector reads only
the engine's facade: `Engine.stats()`, a frozen snapshot the engine thread replaces after every step,
`Engine.load()` and the pool's `usage()` (both take their own locks). Step time and tokens per step go into
two histograms through the engine's `on_step` hook, one observation each per forward pass; the seconds of
each structured output's compile into a third, through its compiler's `on_compile`.

Token counters (`EngineStats`): cached / prompt is the prefix cache's hit rate over admitted prompts. KV
fragmentation is 1 - slots_used / slots_allocated.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from services.worker.core.loop import Engine

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_TOKENS_BUCKETS = tuple(float(2**i) for i in range(14))  # 1 .. 8192
# A grammar compiles in milliseconds, a schema of many optional properties in seconds to minutes.
COMPILE_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector(Collector):
    """Gauges and counters read from an engine at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._engine)

    @staticmethod
    def _families(engine: Engine | None) -> Iterator[Metric]:
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
            "drafts": (
                "pagedserve_worker_spec_drafts",
                "speculative drafts checked, one per sequence and step that had one",
            ),
            "draft_tokens": (
                "pagedserve_worker_spec_draft_tokens",
                "speculative tokens proposed and checked",
            ),
            "accepted": (
                "pagedserve_worker_spec_accepted_tokens",
                "speculative tokens kept: the acceptance rate is these over draft tokens, and a drafted "
                "sequence's tokens per step 1 + these over drafts",
            ),
        }
        if engine is None:
            values: dict[str, int] = {}
        else:
            stats = engine.stats()
            running, waiting = engine.load()
            usage = engine.kv.usage()
            values = {
                "running": running,
                "waiting": waiting,
                "pages": usage.in_use_pages + usage.referenced_pages,
                "allocated": stats.kv_slots_allocated,
                "used": stats.kv_slots_used,
                "preemptions": stats.preemptions,
                "prompt": stats.prompt_tokens,
                "cached": stats.cached_prompt_tokens,
                "generation": stats.generation_tokens,
                "steps": stats.steps,
                "drafts": stats.drafts_checked,
                "draft_tokens": stats.draft_tokens,
                "accepted": stats.accepted_tokens,
            }
        for key, (name, text) in gauges.items():
            yield GaugeMetricFamily(name, text, value=values.get(key))
        for key, (name, text) in counters.items():
            yield CounterMetricFamily(name, text, value=values.get(key))


def instrument(engine: Engine, registry: CollectorRegistry = REGISTRY) -> None:
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
    if engine.grammars is not None:
        engine.grammars.on_compile = Histogram(
            "pagedserve_worker_grammar_compile_seconds",
            "duration of a structured output's compile (cache misses alone; failed ones too): one thread "
            "compiles, and the structured requests behind it wait",
            buckets=COMPILE_SECONDS_BUCKETS,
            registry=registry,
        ).observe
    registry.register(EngineCollector(engine))
