"""Page accounting for one pool: the free list, leases, shared pages and the prefix index.

Every usable page is in exactly one state:
- FREE: on the free list, a stack, so allocation and free are O(1) per page;
- LEASED: held by one lease, idle on its worker's local free list or in use by a sequence;
- SHARED: published to the prefix index or taken by a lookup. It carries a reference count, kept per lease
  so that a lease's end drops exactly its own references. When the count falls to zero the page stays
  cached, evictable least recently used first, if it is in the index, and is freed otherwise (a page whose
  key was already cached by another page).
With a lower tier (`tier`, memory_daemon/tiers.py: host memory, disk), an evicted page's bytes are demoted
there before the page is freed, and a lookup that misses the pool goes on in the tier: each key found
there is promoted into a free page (evicting, and so demoting, an idle one if need be), indexed again and
returned like any hit, under the publisher of the page demoted (`Publishers`).
A cached page may be pinned (`pins`: a request's cache_ttl_seconds): it is then never evicted, and so never
idle in the index's LRU, until its last pin expires; pins are budgeted per tenant and per pool.
Page 0 is the null page: never leased, so block tables can pad with it. Each indexed page's publisher is
recorded (`publishers`), so that `drop_published` can take a worker's entries out, also after it went away;
each call that changes the index ends one batch of its events (`prefix_events`).
`update` and `grant` check a whole request before changing anything, so bad input changes nothing and the
counts stay exact. Misuse raises InvalidArgument, PermissionDenied or FailedPrecondition (the checks are in
`checks`) with a message naming the page and the fix; "no room now" is None, not an error.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from memory_daemon.checks import RequestChecks
from memory_daemon.disk_tier import Kept, StoredPage
from memory_daemon.lease import NULL_PAGE, Lease, PageState
from memory_daemon.pins import Pins
from memory_daemon.prefix import PrefixIndex, Published
from memory_daemon.prefix_events import ModelEvents, Stored
from memory_daemon.publishers import Publishers
from memory_daemon.refill import RefillPolicy, RefillSettings
from memory_daemon.stats import PoolCounts, TenantPins
from memory_daemon.tiers import LowerTier
from pagedserve.plumbing.errors import FailedPrecondition, InvalidArgument
from pagedserve.plumbing.pin_limits import check_tenant, check_ttl


class PinRequest(NamedTuple):
    """Pin the cached pages of a chain of keys for tenant, ttl_s seconds from now (and from each hit)."""

    keys: Sequence[bytes]
    ttl_s: int
    tenant: str


class PageLedger(RequestChecks):
    def __init__(
        self,
        num_pages: int,
        *,
        low_watermark: int = 0,
        refill: RefillSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        tier: LowerTier | None = None,
        pin_share: float = 0.0,  # no pins unless asked: the daemon's are its config's
        tenant_pin_share: float = 0.0,
    ) -> None:
        if num_pages < 2:
            raise InvalidArgument(
                f"a pool needs at least 2 pages (the null page and one more), got {num_pages}"
            )
        self.num_pages = num_pages
        self.low_watermark = low_watermark
        self.index = PrefixIndex()
        self.publishers = Publishers()
        self.leases: dict[str, Lease] = {}
        self._refill = refill or RefillSettings()
        self._clock = clock
        self.tier = tier
        self.pins = Pins(num_pages - 1, pin_share, tenant_pin_share)
        self._announced: set[str] = set()  # models whose pages in the lower tier their events announced
        self._state = bytearray(num_pages)
        self._state[NULL_PAGE] = PageState.NULL
        self._holder: list[Lease | None] = [None] * num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # popped from the end: 1, 2, 3, ...
        self._next_worker_id = 1
        self.evictions = 0
        self.prefix_lookups = 0
        self.prefix_hits = 0
        self.prefix_queried_pages = 0
        self.prefix_hit_pages = 0

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def open_lease(self, name: str, model_id: str) -> Lease:
        lease = Lease(
            lease_id=secrets.token_hex(16),
            worker_id=self._next_worker_id,
            name=name,
            model_id=model_id,
            refill=RefillPolicy(self._refill, last_time=self._clock()),
        )
        self._next_worker_id += 1
        self.leases[lease.lease_id] = lease
        return lease

    def close_lease(self, lease: Lease) -> tuple[int, int]:
        """End a lease: free its pages and drop its references. Returns (pages freed, references dropped)."""
        del self.leases[lease.lease_id]
        leased = list(lease.pages)
        for page in leased:
            self._free_page(page)
        lease.pages.clear()
        dropped = 0
        for page, count in list(lease.refs.items()):
            self._drop_refs(lease, page, count)
            dropped += count
        return len(leased), dropped

    # Allocation ------------------------------------------------------------------------------------

    def refill(self, lease: Lease, need: int, consumed: int, idle: int) -> list[int] | None:
        """Grant a refill sized from the lease's recent consumption: at least `need` pages, or None.

        No single refill takes more than half of what is available unless `need` requires it, so one
        busy worker cannot starve the others.
        """
        for name, value in (("need", need), ("consumed", consumed), ("idle", idle)):
            self._check_count(name, value)
        self._expire_pins()
        lease.refill.observe(consumed, self._clock())
        available = self.free_pages + self.index.evictable_pages
        wanted = max(0, lease.refill.pages - idle)
        pages = self.grant(lease, max(need, min(wanted, available // 2)), need)
        lease.idle = idle + len(pages or ())
        return pages

    def grant(self, lease: Lease, count: int, need: int = 0) -> list[int] | None:
        """Lease `count` pages, or fewer but at least `need`; None if even `need` cannot be had now."""
        self._expire_pins()
        available = self.free_pages + self.index.evictable_pages
        if need > available:
            return None
        count = min(count, available)
        if count <= 0:
            return []
        self._evict(count - self.free_pages)
        pages = self._free[-count:][::-1]
        del self._free[-count:]
        for page in pages:
            self._state[page] = PageState.LEASED
            self._holder[page] = lease
        lease.pages.update(pages)
        self._evict(self.low_watermark - self.free_pages)
        self._commit()
        return pages

    def report_idle(self, lease: Lease, idle: int) -> None:
        """Record how many pages sit on the lease's local free list."""
        self._check_count("idle", idle)
        lease.idle = idle

    def reclaim_plan(self, requester: Lease, shortfall: int) -> list[tuple[Lease, int]]:
        """Which other leases should return how many idle pages to cover shortfall, most idle first."""
        plan = []
        for lease in sorted(self.leases.values(), key=lambda lease: -lease.idle):
            if shortfall <= 0 or lease.idle <= 0:
                break
            if lease is not requester:
                take = min(lease.idle, shortfall)
                plan.append((lease, take))
                shortfall -= take
        return plan

    # Publish, unref, release -----------------------------------------------------------------------

    def update(
        self,
        lease: Lease,
        *,
        publish: Sequence[Published | tuple[bytes, int]] = (),
        pin: Sequence[PinRequest] = (),
        unref: Sequence[int] = (),
        release: Sequence[int] = (),
    ) -> int:
        """Apply one ordered batch, all or nothing; return how many published pages were newly indexed.

        publish: leased pages become shared, one reference held by this lease, and are indexed under their
            key unless another page already holds it.
        pin: the cached pages of each chain are pinned, as far as the tenant's budget goes (`pins`).
        unref: drop one reference per entry.
        release: leased pages go back to the free list.
        """
        items = [Published(*item) for item in publish]
        published = [item.page for item in items]
        self._check_keys([item.key for item in items] + [item.parent for item in items if item.parent])
        for request in pin:
            # Not bounded by the pool: a pin names every group's keys, and a sliding window's pages
            # leave the pool as the sequence runs, so a pin may name more keys than the pool has pages.
            self._check_keys(request.keys)
            check_ttl(request.ttl_s)
            check_tenant(request.tenant)
        self._check_leased_by(lease, published, "publish")
        self._check_leased_by(lease, release, "release")
        both = set(published) & set(release)
        if both:
            raise FailedPrecondition(f"page {min(both)} is both published and released in one update")
        self._check_refs(lease, unref, set(published))

        indexed = 0
        for item in items:
            page = item.page
            lease.pages.remove(page)
            self._holder[page] = None
            self._state[page] = PageState.SHARED
            self._refs[page] = 1
            lease.refs[page] += 1
            if self.index.add(lease.model_id, item.key, page, item.parent, item.token_ids):
                self.publishers.record(page, lease)
                indexed += 1
        for request in pin:
            self._pin(lease.model_id, request)
        for page, count in Counter(unref).items():
            self._drop_refs(lease, page, count)
        for page in release:
            lease.pages.remove(page)
            self._free_page(page)
        self._commit()
        return indexed

    def lookup(self, lease: Lease, keys: Sequence[bytes]) -> list[int]:
        """The longest cached run of pages for a key chain, with a reference taken on each for lease."""
        self._check_chain(keys)
        pages: list[int] = []
        now = self._clock()
        for key in keys:
            page = self.index.get(lease.model_id, key)
            if page is None:
                page = self._promote(lease.model_id, key)
                if page is None:
                    break
            if self._refs[page] == 0:
                self.index.mark_busy(page)
            self.pins.renew(page, now)
            self._refs[page] += 1
            lease.refs[page] += 1
            pages.append(page)
        self.prefix_lookups += 1
        self.prefix_hits += bool(pages)
        self.prefix_queried_pages += len(keys)
        self.prefix_hit_pages += len(pages)
        self._commit()
        return pages

    def check_pins(
        self, tenant: str, pages: int, pool_id: int, model_id: str = "", keys: Sequence[bytes] = ()
    ) -> None:
        """Raise ResourceExhausted, naming the budget, if tenant has no room to pin `pages` more now. keys,
        model_id's keys of some of those pages: the cached ones among them that are pinned already cost
        less (`Pins.check`)."""
        if pages < 0:
            raise InvalidArgument(f"pages must be at least 0, got {pages}")
        if len(keys) > pages:
            raise InvalidArgument(f"{len(keys)} keys for {pages} pages: a key names one of the pages")
        self._check_keys(keys)
        self._expire_pins()
        cached = [page for key in keys if (page := self.index.get(model_id, key)) is not None]
        self.pins.check(tenant, pages, pool_id, cached)

    def promotable(self, model_id: str, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of a chain that the lower tier holds and the pool lacks, up to where neither has one:
        what a prefetch reads (off the event loop) before `admit_promoted`."""
        self._check_chain(keys)
        found = []
        for key in keys:
            if self.index.get(model_id, key) is not None:
                continue
            if self.tier is None or not self.tier.has(model_id, key):
                break
            found.append(key)
        return found

    def admit_promoted(self, model_id: str, pages: Sequence[StoredPage]) -> int:
        """Install pages read from the lower tier into free pages (evicting idle ones if need be), cached
        and unreferenced, the least recently used last; returns how many. A key the pool has by now is
        skipped, and it stops when the pool has no page to spare."""
        assert self.tier is not None, "a pool without a lower tier promotes nothing"
        admitted = 0
        for stored in pages:
            if self.index.get(model_id, stored.key) is not None:
                continue
            if not self._free:
                self._evict(1)
            if not self._free:
                break
            page = self._free.pop()
            with self._back_if_raises(page):
                self.tier.install(model_id, page, stored)
            self._index_promoted(model_id, page, stored)
            self.index.mark_idle(page)
            admitted += 1
        self._commit()
        return admitted

    def cached_run(self, model_id: str, keys: Sequence[bytes]) -> int:
        """How many of the chain's leading keys the pool has cached now."""
        return next((i for i, key in enumerate(keys) if self.index.get(model_id, key) is None), len(keys))

    def drop_published(self, *, worker_id: int = 0, name: str = "") -> int:
        """Take every page the lease with worker_id (or every lease named name) published out of the index,
        and out of the lower tier, where the pool demoted it; returns how many. Idle ones go free now,
        referenced ones when their last reference drops."""
        if not (worker_id or name):
            raise InvalidArgument("name the publisher whose pages to drop: its worker_id or its name")
        pages = self.publishers.pages_of(worker_id=worker_id, name=name)
        copies = set(self.publishers.copies_of(worker_id=worker_id, name=name))
        if self.tier is not None:  # a copy demoted earlier is the same untrusted page
            in_pool = {(entry.model_id, entry.key) for entry in map(self.index.entry, pages)}
            for model_id, key in in_pool | copies:
                self.tier.forget(model_id, key)
                self.publishers.let_go(model_id, key)
            copies -= in_pool
        return self._uncache(pages) + len(copies)

    def flush(self, model_id: str) -> int:
        """Drop every cached page of model_id that no one references, and its pages in the lower tier;
        returns how many pages left the pool."""
        if self.tier is not None:
            self.tier.flush(model_id)
        pinned = [
            page
            for page in self.pins.pages()
            if self._refs[page] == 0 and self.index.entry(page).model_id == model_id
        ]
        return self._uncache(self.index.idle_pages(model_id) + pinned)

    def keep_cached(self) -> None:
        """Copy every cached page onto the lower tier's disk, least recently used first, so that the next
        daemon on it serves them (a graceful stop's); the pool is left as it was."""
        assert self.tier is not None, "a pool without a lower tier keeps nothing"
        idle = self.index.idle_pages_in_order()
        busy = set(self.index.pages()) - set(idle)  # referenced or pinned: in use, so the most recent
        for page in [*idle, *(page for page in self.index.pages() if page in busy)]:
            entry = self.index.entry(page)
            self.tier.persist(entry.model_id, entry.key, page, entry.parent, entry.token_ids)

    def counts(self) -> PoolCounts:
        self._expire_pins()
        leased = sum(len(lease.pages) for lease in self.leases.values())
        return PoolCounts(
            total_pages=self.usable_pages,
            free_pages=self.free_pages,
            leased_pages=leased,
            shared_pages=self.usable_pages - self.free_pages - leased,
            cached_pages=self.index.cached_pages,
            evictable_pages=self.index.evictable_pages,
            evictions=self.evictions,
            prefix_lookups=self.prefix_lookups,
            prefix_hits=self.prefix_hits,
            prefix_queried_pages=self.prefix_queried_pages,
            prefix_hit_pages=self.prefix_hit_pages,
            workers=tuple(lease.usage() for lease in self.leases.values()),
            publishers=self.publishers.usage(),
            pinned_pages=len(self.pins),
            pin_budget_pages=self.pins.budget,
            tenant_pin_budget_pages=self.pins.tenant_budget,
            pins_refused=self.pins.refused,
            tenants=tuple(TenantPins(tenant, pages) for tenant, pages in sorted(self.pins.by_tenant.items())),
        )

    # Internals -------------------------------------------------------------------------------------

    def _free_page(self, page: int) -> None:
        self._state[page] = PageState.FREE
        self._holder[page] = None
        self._free.append(page)

    def _uncache(self, pages: list[int]) -> int:
        for page in pages:
            self.index.remove(page)
            self.publishers.forget(page)
            self.pins.drop(page)
            if self._refs[page] == 0:
                self._free_page(page)
        self._commit()
        return len(pages)

    def _drop_refs(self, lease: Lease, page: int, count: int) -> None:
        lease.refs[page] -= count
        if lease.refs[page] == 0:
            del lease.refs[page]
        self._refs[page] -= count
        if self._refs[page] == 0:
            if page not in self.index:
                self._free_page(page)
            elif page not in self.pins:  # a pinned page turns idle (evictable) when its last pin ends
                self.index.mark_idle(page)

    def events_of(self, model_id: str) -> ModelEvents:
        """The model's index events, the pages its lower tier keeps announced in them first."""
        events = self.index.events_of(model_id)
        self._commit()
        return events

    def _commit(self) -> None:
        """End one call's batch of index events, with the pages the lower tier stored and let go meanwhile;
        the first for a model also announces every page the tier kept for it (a warm restart's), parents
        first."""
        if self.tier is not None:
            for model_id, events in self.index.events.items():
                if model_id not in self._announced:
                    self._announced.add(model_id)
                    for medium, pages in self.tier.kept(model_id).items():
                        for kept in parents_first(pages):
                            events.stored(Stored(kept.key, kept.parent, kept.token_ids, medium))
                for change in self.tier.take_changes(model_id):
                    if isinstance(change, Stored):
                        events.stored(change)
                    else:
                        events.removed(change.key, change.medium)
                        if not self.tier.has(model_id, change.key):
                            self.publishers.let_go(model_id, change.key)
        self.index.commit()

    def _pin(self, model_id: str, request: PinRequest) -> None:
        now = self._clock()
        for key in request.keys:
            page = self.index.get(model_id, key)
            if page is not None and self.pins.add(page, request.tenant, request.ttl_s, now):
                self.index.mark_busy(page)

    def _expire_pins(self) -> None:
        for page in self.pins.expire(self._clock()):
            if self._refs[page] == 0:
                self.index.mark_idle(page)

    def _evict(self, count: int) -> None:
        for _ in range(count):
            page = self.index.oldest_idle()
            if page is None:
                return
            entry = self.index.entry(page)
            kept = self.tier is not None and self.tier.demote(
                entry.model_id, entry.key, page, entry.parent, entry.token_ids
            )  # its events come with the tier's changes, at the commit
            self.index.remove(page)
            self.publishers.left_pool(page, entry.key, kept)
            self._free_page(page)
            self.evictions += 1

    def _promote(self, model_id: str, key: bytes) -> int | None:
        """key's page brought back from the lower tier into a free page, indexed, unreferenced; None if the
        tier lacks it or the pool has no idle page to spare."""
        if self.tier is None or not self.tier.has(model_id, key):
            return None
        if not self._free:
            self._evict(1)
        if not self._free:
            return None
        page = self._free.pop()
        with self._back_if_raises(page):
            found = self.tier.promote(model_id, key, page)
        if found is None:
            self._free.append(page)
            return None
        self._index_promoted(model_id, page, found)
        return page

    @contextlib.contextmanager
    def _back_if_raises(self, page: int) -> Iterator[None]:
        """A free page taken for a tier's copy goes back on the free list if the tier raises."""
        try:
            yield
        except BaseException:
            self._free.append(page)
            raise

    def _index_promoted(self, model_id: str, page: int, stored: StoredPage) -> None:
        self._state[page] = PageState.SHARED
        self.index.add(model_id, stored.key, page, stored.parent, stored.token_ids)
        self.publishers.promoted(page, model_id, stored.key)


def parents_first(pages: Sequence[Kept]) -> list[Kept]:
    """pages reordered so that a page's parent, where it is among them, comes before it."""
    by_key = {page.key: page for page in pages}
    placed: set[bytes] = set()
    ordered: list[Kept] = []
    for page in pages:
        chain: list[Kept] = []
        found: Kept | None = page
        while found is not None and found.key not in placed:
            placed.add(found.key)
            chain.append(found)
            found = by_key.get(found.parent)
        ordered.extend(reversed(chain))
    return ordered
