"""Who published each cached page: the worker's lease (id, name, model), kept for as long as the page is
in the prefix index, and for as long as a lower tier keeps a copy the pool demoted, so that every entry a
worker published can be dropped, also after it went away and after its pages left the pool for a tier. A
page promoted back names its publisher again; one this daemon did not see published (a disk tier's from
before a restart) names the tier."""

from __future__ import annotations

from collections import Counter

from memory_daemon.lease import Lease
from memory_daemon.stats import PublisherUsage

PROMOTED = "(a lower tier)"  # the publisher's name of pages promoted from the disk tier


class Publishers:
    def __init__(self) -> None:
        self._by_page: dict[int, PublisherUsage] = {}  # cached_pages unused here: 0
        self._in_tiers: dict[tuple[str, bytes], PublisherUsage] = {}  # by (model id, key) of a tier's copy

    def record(self, page: int, lease: Lease) -> None:
        self._by_page[page] = PublisherUsage(lease.worker_id, lease.name, lease.model_id, 0)

    def left_pool(self, page: int, key: bytes, kept: bool) -> None:
        """page was evicted, its copy kept in a lower tier under key or not: a copy keeps its publisher."""
        publisher = self._by_page.pop(page, None)
        if publisher is not None and kept:
            self._in_tiers[(publisher.model_id, key)] = publisher

    def promoted(self, page: int, model_id: str, key: bytes) -> None:
        """page came back from a lower tier: its publisher is the copy's, or the tier (worker id 0, which no
        lease has) for a copy from before this daemon."""
        unknown = PublisherUsage(0, PROMOTED, model_id, 0)
        self._by_page[page] = self._in_tiers.get((model_id, key), unknown)

    def forget(self, page: int) -> None:
        self._by_page.pop(page, None)

    def let_go(self, model_id: str, key: bytes) -> None:
        """The lower tiers keep no copy under key any more."""
        self._in_tiers.pop((model_id, key), None)

    def pages_of(self, *, worker_id: int = 0, name: str = "") -> list[int]:
        """The cached pages published by the lease with worker_id, or by every lease named name."""
        return [page for page, publisher in self._by_page.items() if _matches(publisher, worker_id, name)]

    def copies_of(self, *, worker_id: int = 0, name: str = "") -> list[tuple[str, bytes]]:
        """The (model id, key) of each lower tier's copy that such a lease published."""
        return [copy for copy, publisher in self._in_tiers.items() if _matches(publisher, worker_id, name)]

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


def _matches(publisher: PublisherUsage, worker_id: int, name: str) -> bool:
    return publisher.worker_id == worker_id if worker_id else publisher.name == name
