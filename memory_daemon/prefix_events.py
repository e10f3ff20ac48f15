"""The prefix index's changes, per model and numbered: what a gateway's cache-aware routing follows.

Every announced page that enters or leaves the index is recorded as it happens (`PrefixIndex` calls
`stored` and `removed`), and `commit` closes the changes of one ledger call into one numbered batch; a page
published without its tokens (one of a salted prompt, which only that salt may find) is not announced.
Each change names its medium (the pool, or the host-memory or disk tier below it), since a lookup finds a
page in any: a page the pool evicts into a tier leaves the pool and is stored there, one promoted back is
stored in the pool again (and stays in the tier), and one a tier lets go leaves it (from host memory, it
may be stored on disk). A
model's numbers count up by one from the daemon's start time in microseconds, so a restarted daemon's
always number above an old one's, and its first batch says that nothing is cached (cleared).
A new subscriber (after 0) first gets the whole state, numbered up to the last batch: cleared, then every
cached page, parents before children. A batch holds at most about MAX_BATCH_BYTES of changes on the wire: a
larger set of changes (a flush, a restart's disk tier) is committed as consecutively numbered batches, and a
larger state goes out in parts numbered consecutively up to the last batch, so that a gateway that checks
each number follows one after another (SMG reads a message of 4 MiB at most). One that goes away partway
through the parts of the state resumes from the history, and knows fewer pages than are cached until it
subscribes from 0 again. One that names the last batch it has gets the batches after it from
the history, or OutOfRange when the history no longer holds them (another daemon's numbers, or too old):
it must drop what it knows and subscribe from 0. One that falls MAX_BEHIND batches behind gets DataLoss,
with the same remedy. These are the statuses SMG's gateway acts on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedserve.plumbing.errors import DataLoss, OutOfRange, StatusError

HISTORY_BATCHES = 4096
MAX_BEHIND = 4096
MAX_BATCH_BYTES = 1 << 20  # a quarter of what SMG's client reads in one message (tonic's default)


# A cached page's medium: the daemon's pool (device memory), the host-memory tier, or the disk tier.
POOL, HOST, DISK = "pool", "host", "disk"


@dataclass(frozen=True)
class Stored:
    key: bytes
    parent: bytes  # the key before it in its chain; empty for a prompt's first page
    token_ids: tuple[int, ...]
    medium: str = POOL


@dataclass(frozen=True)
class Removed:
    key: bytes
    medium: str = POOL


@dataclass(frozen=True)
class Cleared:
    pass


Change = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    sequence: int
    timestamp: float
    changes: tuple[Change, ...]


class Subscription:
    """A subscriber's next batches; `close` it when done."""

    def __init__(self, events: ModelEvents, backlog: list[Batch]) -> None:
        self._events = events
        self._queue: asyncio.Queue[Batch | StatusError] = asyncio.Queue()
        for batch in backlog:
            self._queue.put_nowait(batch)

    async def next(self) -> Batch:
        batch = await self._queue.get()
        if isinstance(batch, StatusError):
            raise batch
        return batch

    def offer(self, batch: Batch) -> None:
        if self._queue.qsize() >= MAX_BEHIND:  # it does not keep up: what it has is no longer worth having
            self.end(DataLoss(f"this subscriber fell {MAX_BEHIND} batches behind; subscribe again from 0"))
        else:
            self._queue.put_nowait(batch)

    def end(self, why: StatusError) -> None:
        """No more batches: `next` raises why once the subscriber has those it was given."""
        self.close()
        self._queue.put_nowait(why)

    def close(self) -> None:
        self._events.subscribers.discard(self)


class ModelEvents:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.sequence = int(clock() * 1e6)
        self._history: deque[Batch] = deque(maxlen=HISTORY_BATCHES)
        self._pending: list[Change] = []
        # In the order stored, a parent before its children; a page may be live in both media.
        self._live: dict[tuple[bytes, str], Stored] = {}
        self.subscribers: set[Subscription] = set()
        self._history.append(Batch(self.sequence, clock(), (Cleared(),)))

    def stored(self, change: Stored) -> None:
        if change.token_ids and (change.key, change.medium) not in self._live:
            self._pending.append(change)
            self._live[change.key, change.medium] = change

    def removed(self, key: bytes, medium: str = POOL) -> None:
        """Record a page leaving a medium; nothing for one never announced there (a salted prompt's)."""
        if self._live.pop((key, medium), None) is not None:
            self._pending.append(Removed(key, medium))

    def commit(self) -> None:
        if not self._pending:
            return
        for part in _parts(self._pending):
            self.sequence += 1
            batch = Batch(self.sequence, self._clock(), part)
            self._history.append(batch)
            for subscriber in list(self.subscribers):  # offer may drop one
                subscriber.offer(batch)
        self._pending.clear()

    def snapshot(self) -> list[Batch]:
        """The whole state, in parts numbered up to the last batch: what a subscriber holds once it has
        them."""
        parts = _parts((Cleared(), *self._live.values()))
        first, now = self.sequence - len(parts) + 1, self._clock()
        return [Batch(first + i, now, part) for i, part in enumerate(parts)]

    def end_subscriptions(self, why: StatusError) -> None:
        for subscription in list(self.subscribers):
            subscription.end(why)

    def subscribe(self, after: int) -> Subscription:
        """The batches after `after` (the whole state, for 0), then each new one."""
        if not after:
            backlog = self.snapshot()
        elif self._history[0].sequence <= after + 1 and after <= self.sequence:
            backlog = [batch for batch in self._history if batch.sequence > after]
        else:
            raise OutOfRange(
                f"batch {after} is not in this daemon's history ({self._history[0].sequence} to "
                f"{self.sequence}); drop what you know and subscribe from 0"
            )
        subscription = Subscription(self, backlog)
        self.subscribers.add(subscription)
        return subscription


def _parts(changes: Sequence[Change]) -> list[tuple[Change, ...]]:
    """changes, in order, cut into batches of at most about MAX_BATCH_BYTES on the wire."""
    parts: list[tuple[Change, ...]] = []
    start, size = 0, 0
    for i, change in enumerate(changes):
        cost = _wire_bytes(change)
        if i > start and size + cost > MAX_BATCH_BYTES:
            parts.append(tuple(changes[start:i]))
            start, size = i, 0
        size += cost
    return [*parts, tuple(changes[start:])]


def _wire_bytes(change: Change) -> int:
    """No less than what a change takes in a batch on the wire, the daemon's or SMG's: a token id takes at
    most 5 bytes, a key at most itself (SMG's hash of it 10) with its tag and length, and the rest 32."""
    if isinstance(change, Stored):
        return len(change.key) + len(change.parent) + 5 * len(change.token_ids) + 32
    if isinstance(change, Removed):
        return len(change.key) + 16
    return 4
