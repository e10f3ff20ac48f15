"""Per-request timings, and what a run amounts to: latency percentiles, throughput and goodput."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    sent: float  # perf_counter when the request left (its arrival)
    token_times: list[float] = field(default_factory=list)  # when each output token arrived
    done: float | None = None
    cached_prompt_tokens: int = 0
    status: str = "OK"  # the gRPC status name, or the baseline's "OK"

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, record: RequestRecord) -> bool:
        ttft, tpot = record.ttft, record.tpot
        return (
            record.status == "OK"
            and ttft is not None
            and ttft <= self.ttft_s
            and (tpot or 0.0) <= self.tpot_s
        )


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points, strict=True)}


def summarize(records: list[RequestRecord], slo: Slo) -> dict:
    """The run's figures; the clock runs from the first arrival to the last finish."""
    ok = [r for r in records if r.status == "OK"]
    start = min(r.sent for r in records)
    end = max([r.done for r in records if r.done is not None] or [start])
    duration = max(end - start, 1e-9)
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    gaps = [b - a for r in ok for a, b in itertools.pairwise(r.token_times) if b > a]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": dict(Counter(r.status for r in records if r.status != "OK")),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": output,
        "output_tokens_per_s": output / duration,
        "total_tokens_per_s": (prompt + output) / duration,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": percentiles(gaps),
        "goodput_requests_per_s": sum(slo.met(r) for r in records) / duration,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
    }
