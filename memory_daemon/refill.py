"""Pre-allocation from history: size each worker's refill from its recent page consumption.

A worker that burns pages fast gets large refills, so it calls the daemon rarely; an idle one gets small
ones, so it does not sit on pages others need. The rate is an exponentially weighted moving average in
time (not in calls), so it means pages per second whatever the call pattern.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.plumbing.settings import setting


@dataclass(frozen=True)
class RefillSettings:
    min_pages: int = setting(8, "the smallest refill, in pages", flag="--min-refill")
    max_pages: int = setting(4096, "the largest refill, in pages", flag="--max-refill")
    horizon_s: float = 1.0  # a refill should last this long at the recent rate
    half_life_s: float = 2.0  # how fast the rate forgets

    def __post_init__(self) -> None:
        if not 1 <= self.min_pages <= self.max_pages:
            raise ValueError(
                f"refill needs 1 <= min_pages <= max_pages, got {self.min_pages}, {self.max_pages}"
            )
        if self.horizon_s <= 0 or self.half_life_s <= 0:
            raise ValueError("refill horizon and half-life must be positive")


@dataclass
class RefillPolicy:
    settings: RefillSettings
    last_time: float  # when consumption was last observed
    rate: float = 0.0  # pages per second

    def observe(self, consumed: int, now: float) -> None:
        """Record that `consumed` pages were allocated locally since the last observation."""
        elapsed = max(now - self.last_time, 1e-3)
        weight = 1.0 - 0.5 ** (elapsed / self.settings.half_life_s)
        self.rate += weight * (consumed / elapsed - self.rate)
        self.last_time = now

    @property
    def pages(self) -> int:
        wanted = math.ceil(self.rate * self.settings.horizon_s)
        return max(self.settings.min_pages, min(self.settings.max_pages, wanted))
