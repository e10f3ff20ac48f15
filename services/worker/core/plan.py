"""What a step is made of: each sequence's share (ScheduledSeq), the scheduler's plan, and the plan once it is
launched on the device."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.core.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # the first new token's position
    count: int  # new tokens this step

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.count)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so the step samples its next token."""
        return self.start + self.count == self.seq.num_tokens


@dataclass(frozen=True)
class Launch:
    """A committed plan on its way through the device: what its postprocess needs."""

    number: int  # steps committed before it, and it
    items: list[ScheduledSeq]
    epochs: list[int]  # each item's sequence's epoch when it was committed
    sampled: list[Sequence]  # the sequences it samples a token for, in order


@dataclass(frozen=True)
class Plan:
    items: list[ScheduledSeq]
    finished: list[Sequence]  # ended while scheduling: the pool cannot hold them even alone
