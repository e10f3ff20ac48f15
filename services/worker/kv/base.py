"""The worker's side of the page pool: local sub-allocation from a bulk lease.

A page the worker holds is either leased (its own: idle on the local free list, or in use by a sequence)
or shared (published to the prefix index, or found by a lookup; held by one reference). `allocate` and
`free` touch only local lists under a lock; subclasses move pages to and from the pool's owner in bulk:
a refill when the idle list runs low, a release when it grows past twice the refill size, and one ordered
batch of publishes, unrefs and releases at a time.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from memory_daemon.ledger import PinRequest
from memory_daemon.prefix import ROOT_KEY, Published
from memory_daemon.shape import PoolShape
from memory_daemon.stats import PoolCounts
from pagedserve.plumbing.errors import Unavailable


class PoolLost(Unavailable):
    """The pool's owner (the memory daemon) is out of reach, and with it every page this worker held."""


@dataclass(frozen=True)
class LocalUsage:
    idle_pages: int  # leased, on the local free list
    in_use_pages: int  # leased, allocated to sequences
    referenced_pages: int  # shared pages this worker holds a reference on


class KVCache(ABC):
    """The pool as a tensor `kv` of shape [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]."""

    lower_tier = False  # whether the pool's owner keeps evicted pages in a lower tier (`warm`)
    pin_budget_pages = 0  # pages that pins may hold, out of any request's reach (never evictable)

    def __init__(self, kv: torch.Tensor, shape: PoolShape, refill_pages: int) -> None:
        self.kv = kv
        self.shape = shape
        self._lock = threading.Lock()
        self._idle: list[int] = []
        self._in_use: set[int] = set()
        self._refs: Counter[int] = Counter()
        self._drawn = 0  # net pages taken off the idle list since the last lease call
        self._refill_pages = refill_pages
        self.published = 0  # pages this cache has published so far: a mark for `delivered`

    @property
    def page_size(self) -> int:
        return self.shape.page_size

    @property
    def num_pages(self) -> int:
        return self.kv.shape[2]

    def allocate(self, n: int) -> list[int] | None:
        """Take n pages for a sequence; None if the pool has no room now (the caller may preempt)."""
        if not 0 < n < self.num_pages:
            raise ValueError(f"allocate takes 1 to the pool's {self.num_pages - 1} pages, got {n}")
        with self._lock:
            short = n - len(self._idle)
        if short > 0:
            self._prefetch(short)
        with self._lock:
            if len(self._idle) < n:
                return None
            pages = self._idle[-n:]
            del self._idle[-n:]
            self._in_use.update(pages)
            self._drawn += n
            running_low = len(self._idle) < self._refill_pages // 2
        if running_low:
            self._request_refill()
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Give back a sequence's pages: leased ones return to the idle list, shared ones drop a reference."""
        with self._lock:
            for page, count in Counter(pages).items():
                held = self._refs[page] + (page in self._in_use)
                if count > held:
                    raise ValueError(
                        f"page {page} is not held by this worker {count} time(s) (a double free?)"
                    )
            unref = []
            for page in pages:
                if page in self._in_use:
                    self._in_use.remove(page)
                    self._idle.append(page)
                    self._drawn -= 1
                else:
                    self._drop_ref(page)
                    unref.append(page)
            excess = len(self._idle) - 2 * self._refill_pages
            release = self._idle[:excess] if excess > 0 else []
            del self._idle[: len(release)]
            if unref or release:
                self._submit(len(self._idle), unref=unref, release=release)

    def publish(
        self,
        keys: Sequence[bytes],
        pages: Sequence[int],
        *,
        parent: bytes = ROOT_KEY,
        tokens: Sequence[int] = (),
    ) -> int:
        """Offer full pages to the prefix cache under their chain keys (memory_daemon.prefix.page_keys).

        parent is the chain's key before keys[0], and tokens the pages' tokens, for the index's events.
        Pages already shared are skipped, so a caller may pass a sequence's whole block table. A published
        page stays the caller's, held by reference: `free` it as before. Returns how many were published.
        """
        if len(keys) != len(pages):
            raise ValueError(f"publish needs one key per page, got {len(keys)} keys for {len(pages)} pages")
        size = self.page_size
        parents = [parent, *keys[:-1]]
        with self._lock:
            for page in pages:
                if page not in self._in_use and not self._refs[page]:
                    raise ValueError(f"cannot publish page {page}: this worker does not hold it")
            items = [
                Published(key, page, parents[i], tuple(tokens[i * size : (i + 1) * size]))
                for i, (key, page) in enumerate(zip(keys, pages, strict=True))
                if page in self._in_use
            ]
            for _, page, _, _ in items:
                self._in_use.remove(page)
                self._refs[page] += 1
            if items:
                self.published += len(items)
                self._submit(len(self._idle), publish=items)
        return len(items)

    def pin(self, keys: Sequence[bytes], ttl_s: int, tenant: str) -> None:
        """Pin the cached pages of keys' chain for tenant, ttl_s seconds from now and from each hit: sent
        in order after the pages' publishes, so call it before freeing them."""
        if keys:
            with self._lock:
                self._submit(len(self._idle), pin=[PinRequest(list(keys), ttl_s, tenant)])

    @abstractmethod
    def check_pins(self, tenant: str, keys: Sequence[bytes]) -> None:
        """Raise ResourceExhausted, naming the budget, if tenant has no room to pin the pages of keys now
        (those cached and pinned already cost less: `PageLedger.check_pins`)."""

    def delivered(self, mark: int) -> bool:
        """Whether the first `mark` pages this cache published have reached the pool's owner, so that a
        lookup finds them."""
        return True  # for a cache whose updates apply when they are made

    def warm(self, keys: Sequence[bytes]) -> None:
        """A request for keys' chain has arrived: have the pool's owner bring pages of it that sit in a lower
        tier back into the pool, in the background, before the lookup; any thread may call it. Nothing to
        do for a pool without one."""
        return None

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages for the longest matching run of keys, each held by one reference; pages this
        cache published are found once `delivered`."""
        if not keys:
            return []
        pages = self._lookup(keys)
        with self._lock:
            self._refs.update(pages)
        return pages

    def usage(self) -> LocalUsage:
        with self._lock:
            return LocalUsage(len(self._idle), len(self._in_use), sum(self._refs.values()))

    @abstractmethod
    def flush(self) -> None:
        """Wait until every queued publish, unref and release has reached the pool's owner."""

    @abstractmethod
    def stats(self) -> PoolCounts:
        """The pool's counts, as its owner sees them."""

    @abstractmethod
    def close(self) -> None:
        """End the lease; every page it holds goes back, published pages stay cached."""

    # Hooks for subclasses --------------------------------------------------------------------------

    @abstractmethod
    def _lease(self, need: int, consumed: int, idle: int) -> tuple[list[int], int]:
        """Ask for a refill of at least `need` pages (0: the suggested size); return (pages, refill size)."""

    @abstractmethod
    def _submit(
        self,
        idle: int,
        *,
        publish: Sequence[Published] = (),
        pin: Sequence[PinRequest] = (),
        unref: Sequence[int] = (),
        release: Sequence[int] = (),
    ) -> None:
        """Pass on one batch, in order; called with the lock held."""

    @abstractmethod
    def _lookup(self, keys: Sequence[bytes]) -> list[int]: ...

    @abstractmethod
    def _request_refill(self) -> None:
        """The idle list runs low: refill it now or soon, through `_prefetch`."""

    # Helpers for subclasses ------------------------------------------------------------------------

    def _prefetch(self, need: int = 0) -> None:
        """Refill the idle list with at least need pages (0: the suggested number). The lease is taken
        without the lock: a paused daemon holds the call to its deadline, and meanwhile the worker's load
        reports (usage) and the daemon's reclaims take the lock."""
        with self._lock:
            drawn, idle = self._take_drawn(), len(self._idle)
        grant = self._lease(need, drawn, idle)
        with self._lock:
            self._accept(*grant)

    def _return_idle(self, n: int) -> int:
        """Release up to n idle pages, at the owner's request; return how many."""
        with self._lock:
            release = self._idle[:n]
            del self._idle[: len(release)]
            if release:
                self._submit(len(self._idle), release=release)
        return len(release)

    def _take_drawn(self) -> int:
        """The consumption to report: pages recycled through the idle list do not count."""
        drawn, self._drawn = max(self._drawn, 0), 0
        return drawn

    def _accept(self, pages: list[int], refill_pages: int) -> None:
        self._idle.extend(pages)
        self._refill_pages = refill_pages

    def _drop_ref(self, page: int) -> None:
        self._refs[page] -= 1
        if not self._refs[page]:
            del self._refs[page]
