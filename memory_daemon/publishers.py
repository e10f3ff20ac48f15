"""Who published each cached page: the worker's lease (id, name, model), kept for as long as the page is
in the prefix index, so that every entry a worker published can be dropped, also after it went away."""

from __future__ import annotations

from collections import Counter

from memory_daemon.lease import Lease
from memory_daemon.stats import PublisherUsage

PROMOTED = "(a lower tier)"  # the publisher's name of pages promoted from the disk tier


class Publishers:
    def __init__(self) -> None:
        self._by_page: dict[int, PublisherUsage] = {}  # cached_pages unused here: 0

    def record(self, page: int, lease: Lease) -> None:
        self._by_page[page] = PublisherUsage(lease.worker_id, lease.name, lease.model_id, 0)

    def record_promoted(self, page: int, model_id: str) -> None:
        """page came back from a lower tier: its publisher is that tier (worker id 0, which no lease has)."""
        self._by_page[page] = PublisherUsage(0, PROMOTED, model_id, 0)

    def forget(self, page: int) -> None:
        self._by_page.pop(page, None)

    def pages_of(self, *, worker_id: int = 0, name: str = "") -> list[int]:
        """The cached pages published by the lease with worker_id, or by every lease named name."""
        return [
            page
            for page, publisher in self._by_page.items()
            if (publisher.worker_id == worker_id if worker_id else publisher.name == name)
        ]

    def usage(self) -> tuple[PublisherUsage, ...]:
        """Each publisher with pages still cached, and how many; oldest worker first."""
        counts = Counter(self._by_page.values())
        return tuple(
            PublisherUsage(p.worker_id, p.name, p.model_id, count)
            for p, count in sorted(counts.items(), key=lambda item: item[0].worker_id)
        )

    def __contains__(self, page: int) -> bool:
        return page in self._by_page

    def __len__(self) -> int:
        return len(self._by_page)
