"""Admission control: a bound on running requests, and a bounded queue behind it, best priority first.

A request holds a slot while it runs in a worker. When every slot is taken it waits in a queue ordered by
priority (lower first), then arrival; when the queue is full too, it is refused with RESOURCE_EXHAUSTED at
once, so a burst cannot grow memory without bound.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pagedserve.plumbing.errors import ResourceExhausted


class Admission:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be positive and max_waiting not negative")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: int) -> None:
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            return
        if len(self._waiting) >= self.max_waiting:
            raise ResourceExhausted(
                f"the server is full: {self.running} requests running and {len(self._waiting)} queued; "
                "retry later"
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), turn)
        heapq.heappush(self._waiting, entry)
        try:
            await turn  # _release hands over its slot: running stays counted
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # the slot arrived as the caller gave up: pass it on
            elif entry in self._waiting:  # _release may already have popped and skipped it
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def _release(self) -> None:
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1
