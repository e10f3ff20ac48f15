"""For the admission tests: one event loop per test under a short overall timeout, so that a lost slot
shows up as a failure instead of a hang, and requests that hold their slot or record when they got it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from services.frontend.admission import Admission, Client

T = TypeVar("T")
TIMEOUT_S = 5.0


def run(test: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(test(), TIMEOUT_S)

    return asyncio.run(bounded())


async def settle() -> None:
    """Let every ready task run until it blocks (a handful of loop turns is plenty here)."""
    for _ in range(5):
        await asyncio.sleep(0)  # one turn of this loop, not a wait for time: it runs alike on any machine


class Gate:
    """A request that holds its slot until opened."""

    def __init__(self, admission: Admission, priority: int = 0, client: Client = "a") -> None:
        self.entered = False
        self._open = asyncio.Event()
        self.task = asyncio.create_task(self._hold(admission, priority, client))

    async def _hold(self, admission: Admission, priority: int, client: Client) -> None:
        async with admission.slot(priority, client):
            self.entered = True
            await self._open.wait()

    def open(self) -> None:
        self._open.set()


def enqueue(
    admission: Admission, entered: list[str], name: str, priority: int = 0, client: Client = "a"
) -> asyncio.Task[None]:
    """A request that records `name` in `entered` as soon as it gets its slot, then leaves."""

    async def request() -> None:
        async with admission.slot(priority, client):
            entered.append(name)

    return asyncio.create_task(request(), name=name)


async def enqueue_in_order(
    admission: Admission, entered: list[str], requests: Sequence[tuple[str, int]]
) -> dict[str, asyncio.Task[None]]:
    """Queue (name, priority) requests one after the other, so that their arrival order is the list's."""
    tasks = {}
    for name, priority in requests:
        tasks[name] = enqueue(admission, entered, name, priority)
        await settle()
    return tasks


def assert_idle(admission: Admission) -> None:
    assert (admission.running, admission.waiting) == (0, 0)
