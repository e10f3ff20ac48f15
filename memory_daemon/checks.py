"""The checks a PageLedger runs on a request before it changes anything, so that bad input changes nothing,
and the audit of its books (`check_invariants`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from memory_daemon.lease import NULL_PAGE, Lease, PageState
from memory_daemon.pins import Pins
from memory_daemon.prefix import MAX_KEY_BYTES, PrefixIndex
from memory_daemon.publishers import Publishers
from pagedserve.plumbing.errors import FailedPrecondition, Internal, InvalidArgument, PermissionDenied


class RequestChecks:
    """Mixed into PageLedger, whose page states, holders and size it reads."""

    num_pages: int
    _state: bytearray
    _holder: list[Lease | None]
    _free: list[int]
    _refs: list[int]
    leases: dict[str, Lease]
    index: PrefixIndex
    publishers: Publishers
    pins: Pins

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    def check_invariants(self) -> None:
        """Raise Internal, naming what broke, unless every page is accounted for exactly once."""
        _require(self._state[NULL_PAGE] == PageState.NULL and NULL_PAGE not in self._free, "the null page")
        _require(len(set(self._free)) == len(self._free), "a page is on the free list twice")
        _require(
            all(self._state[p] == PageState.FREE for p in self._free), "a page on the free list is not free"
        )
        _require(self._state.count(PageState.FREE) == len(self._free), "a free page is not on the free list")
        leased = [p for lease in self.leases.values() for p in lease.pages]
        _require(
            len(leased) == len(set(leased)) == self._state.count(PageState.LEASED),
            "leased pages and the leases' books differ",
        )
        for lease in self.leases.values():
            _require(all(self._holder[p] is lease for p in lease.pages), f"lease {lease.name}'s pages")
        held: Counter[int] = Counter()
        for lease in self.leases.values():
            held.update(lease.refs)
        for page in range(1, self.num_pages):
            if self._state[page] == PageState.SHARED:
                _require(
                    self._refs[page] == held[page], f"page {page}: {self._refs[page]} refs, {held[page]} held"
                )
                _require(self._refs[page] > 0 or page in self.index, f"page {page}: shared, unheld, uncached")
            else:
                _require(
                    self._refs[page] == 0 and page not in self.index and held[page] == 0,
                    f"page {page}: not shared, yet referenced or cached",
                )
            _require((page in self.index) == (page in self.publishers), f"page {page}: index and publishers")
            if page in self.pins:
                _require(page in self.index, f"page {page}: pinned, uncached")
                _require(not self.index.is_idle(page), f"page {page}: pinned, yet evictable")
        pins = self.pins
        _require(len(pins) <= pins.budget, f"{len(pins)} pages pinned, over the pool's {pins.budget}")
        for tenant, pages in pins.by_tenant.items():
            _require(
                pages <= pins.tenant_budget, f"tenant {tenant!r} pins {pages}, over {pins.tenant_budget}"
            )

    def _check_page_id(self, page: int) -> None:
        if not NULL_PAGE < page < self.num_pages:
            null = " (page 0 is the null page and is never leased)" if page == NULL_PAGE else ""
            raise InvalidArgument(
                f"page {page} is out of range: this pool's pages are 1..{self.num_pages - 1}{null}"
            )

    def _check_leased_by(self, lease: Lease, pages: Iterable[int], verb: str) -> None:
        seen: set[int] = set()
        for page in pages:
            self._check_page_id(page)
            if page in seen:
                raise FailedPrecondition(f"cannot {verb} page {page} twice in one update")
            seen.add(page)
            state, holder = self._state[page], self._holder[page]
            if state == PageState.LEASED and holder is lease:
                continue
            if state == PageState.FREE:
                raise FailedPrecondition(f"cannot {verb} page {page}: it is already free (a double free?)")
            if state == PageState.LEASED:
                raise PermissionDenied(f"cannot {verb} page {page}: it is leased to {holder}, not to {lease}")
            raise FailedPrecondition(
                f"cannot {verb} page {page}: it is shared, not leased; drop your reference with unref instead"
            )

    def _check_refs(self, lease: Lease, unref: Sequence[int], published: set[int]) -> None:
        for page, count in Counter(unref).items():
            self._check_page_id(page)
            held = lease.refs[page] + (page in published)
            if count <= held:
                continue
            if self._state[page] == PageState.LEASED and page not in published:
                raise FailedPrecondition(
                    f"cannot unref page {page}: it is leased, not shared; release it instead"
                )
            raise FailedPrecondition(
                f"cannot unref page {page} {count} time(s): {lease} holds {held} reference(s) on it "
                "(a double free?)"
            )

    def _check_count(self, name: str, value: int) -> None:
        if not 0 <= value <= self.usable_pages:
            raise InvalidArgument(
                f"{name} must be between 0 and the pool's {self.usable_pages} pages, got {value}"
            )

    def _check_chain(self, keys: Sequence[bytes]) -> None:
        """A chain of keys (a lookup's, a prefetch's): no longer than the pool; each key sound."""
        if len(keys) > self.usable_pages:
            raise InvalidArgument(f"{len(keys)} keys is more than the pool's {self.usable_pages} pages")
        self._check_keys(keys)

    @staticmethod
    def _check_keys(keys: Iterable[bytes]) -> None:
        for key in keys:
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise InvalidArgument(f"a page key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")


def _require(holds: bool, what: str) -> None:
    if not holds:
        raise Internal(f"the page books do not balance: {what}")
