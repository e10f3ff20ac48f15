"""Admission control: a bound on running requests, a bounded queue behind it, and each client's share.

A request holds a slot while it runs in a worker. When every slot is taken it waits in a queue ordered by
priority (lower first), then arrival; when the queue is full too, it is refused with RESOURCE_EXHAUSTED at
once, so a burst cannot grow memory without bound.

One client cannot starve the others: a client (`identity`: its token, else its address) holds at most its
share of the running slots and of the queue (--client-share), and a freed slot goes to the best waiter of
a client still under its share, so another client's request is admitted while the first one's queue is
long, whatever priorities it chose. The gateway's requests (client None) carry many users' traffic, which
the gateway itself limits: they count toward the totals only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pagedserve.plumbing.errors import ResourceExhausted

Client = str | None  # None: the gateway, which has no share of its own
_Waiter = tuple[int, int, asyncio.Future[None]]  # (priority, arrival, turn)


class Admission:
    def __init__(self, max_running: int, max_waiting: int, client_share: float = 1.0) -> None:
        if max_running < 1 or max_waiting < 0 or not 0 < client_share <= 1:
            raise ValueError("max_running must be positive, max_waiting not negative, client_share in (0, 1]")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.client_share = client_share
        self.running = 0
        self.waiting = 0  # an int, not a sum over the queues: the metrics' scrape thread reads it
        self._running: Counter[Client] = Counter()
        self._waiting: dict[Client, list[_Waiter]] = {}
        self._arrivals = itertools.count()

    def running_of(self, client: Client) -> int:
        return self._running[client]

    def running_cap(self, client: Client) -> int:
        return self.max_running if client is None else math.ceil(self.max_running * self.client_share)

    def waiting_cap(self, client: Client) -> int:
        return self.max_waiting if client is None else math.ceil(self.max_waiting * self.client_share)

    @asynccontextmanager
    async def slot(self, priority: int, client: Client) -> AsyncIterator[None]:
        await self._acquire(priority, client)
        try:
            yield
        finally:
            self._release(client)

    async def _acquire(self, priority: int, client: Client) -> None:
        if self.running < self.max_running and self._running[client] < self.running_cap(client):
            self._grant(client)  # no waiter could have it: each freed slot goes to one at once
            return
        self._check_room(client)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), turn)
        heapq.heappush(self._waiting.setdefault(client, []), entry)
        self.waiting += 1
        try:
            await turn  # _dispatch hands over a slot: running stays counted
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(client)  # the slot arrived as the caller gave up: pass it on
            else:
                self._forget(client, entry)
            raise

    def _check_room(self, client: Client) -> None:
        if self.waiting >= self.max_waiting:
            raise ResourceExhausted(
                f"the server is full: {self.running} requests running and {self.waiting} queued; retry later"
            )
        queued = len(self._waiting.get(client, ()))
        if queued >= self.waiting_cap(client):
            raise ResourceExhausted(
                f"this client ({client}) has {self._running[client]} requests running and {queued} queued, "
                f"its share of this server (--client-share {self.client_share:g} of --max-running "
                f"{self.max_running} and --max-waiting {self.max_waiting}); retry when some have ended"
            )

    def _grant(self, client: Client) -> None:
        self.running += 1
        self._running[client] += 1

    def _release(self, client: Client) -> None:
        self.running -= 1
        self._running[client] -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to the best waiters (priority, then arrival) of clients under their share."""
        while self.running < self.max_running:
            heads = [
                (queue[0], client)
                for client, queue in self._waiting.items()
                if self._running[client] < self.running_cap(client)
            ]
            if not heads:
                return
            _, client = min(heads, key=lambda head: head[0][:2])
            _, _, turn = heapq.heappop(self._waiting[client])
            self.waiting -= 1
            if not self._waiting[client]:
                del self._waiting[client]
            if not turn.done():  # else its caller gave up, and is on its way out of _acquire
                self._grant(client)
                turn.set_result(None)

    def _forget(self, client: Client, entry: _Waiter) -> None:
        queue = self._waiting.get(client)
        if queue is not None and entry in queue:
            queue.remove(entry)
            self.waiting -= 1
            heapq.heapify(queue)
            if not queue:
                del self._waiting[client]
