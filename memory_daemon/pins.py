"""Pins: cached pages a tenant keeps a while after its request ended (GenerateRequest.cache_ttl_seconds).

A pinned page is never evicted, so pins are budgeted: a tenant may pin at most its share of a pool's pages
(--tenant-pin-share) and all tenants together the pool's pin share (--pin-share), which leaves the rest of
the pool to the working set: a worker refuses a request that needs more than that rest, which it would
otherwise wait for until pins expire. Each tenant pays for its own pins of a page: two tenants pinning one
prompt both count it, and the page stays pinned until the last pin ends. A hit on a pinned page renews
every pin on it, each by its own TTL, the way a prompt-cache hit renews the entry in Anthropic's API. Pins
end lazily: `expire` runs before any decision that depends on them, with a heap of (expiry, page, tenant)
whose stale entries (renewed pins) are skipped, and rebuilt when they outnumber the live ones."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from pagedserve.plumbing.errors import ResourceExhausted
from pagedserve.plumbing.pin_limits import check_tenant


class Pin(NamedTuple):
    ttl_s: float
    expires: float


class Pins:
    def __init__(self, usable_pages: int, pin_share: float, tenant_pin_share: float) -> None:
        self.budget = int(pin_share * usable_pages)
        self.tenant_budget = min(int(tenant_pin_share * usable_pages), self.budget)
        self._shares = (pin_share, tenant_pin_share)
        self._of_page: dict[int, dict[str, Pin]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self.by_tenant: Counter[str] = Counter()
        self.refused = 0  # pages a pin asked for beyond a budget, left unpinned

    def __contains__(self, page: int) -> bool:
        return page in self._of_page

    def __len__(self) -> int:
        return len(self._of_page)

    def pages(self) -> Iterator[int]:
        return iter(list(self._of_page))

    def room(self, tenant: str) -> int:
        """How many more pages tenant may pin now."""
        return max(0, min(self.tenant_budget - self.by_tenant[tenant], self.budget - len(self)))

    def check(self, tenant: str, pages: int, pool_id: int, cached: Iterable[int] = ()) -> None:
        """Refuse, naming the budget, a request that would pin more pages than tenant has room for. Of its
        pages, those `cached` already cost the tenant nothing where it pins them (as `add` charges), and
        the pool nothing where anyone does: a conversation that goes on renews its pins."""
        check_tenant(tenant)
        pinned = [self._of_page.get(page, {}) for page in cached]
        for_tenant = pages - sum(tenant in pins for pins in pinned)
        for_pool = pages - sum(bool(pins) for pins in pinned)
        pin_share, tenant_share = self._shares
        if self.by_tenant[tenant] + for_tenant > self.tenant_budget:
            held, budget, more = self.by_tenant[tenant], self.tenant_budget, for_tenant
            flag = f"--tenant-pin-share {tenant_share}"
            whose = f"tenant {tenant!r} has"
        elif len(self) + for_pool > self.budget:
            held, budget, more, flag = len(self), self.budget, for_pool, f"--pin-share {pin_share}"
            whose = "all tenants together have"
        else:
            return
        raise ResourceExhausted(
            f"{whose} pinned {held} of the {budget} pages allowed in pool {pool_id} ({flag} of its pages), "
            f"and this request would pin {more} more: send it without cache_ttl_seconds, or wait for pins "
            "to expire"
        )

    def add(self, page: int, tenant: str, ttl_s: float, now: float) -> bool:
        """Pin page for tenant until now + ttl_s (or renew its pin); False if tenant has no room for it."""
        pins = self._of_page.get(page, {})
        if tenant in pins:
            ttl_s = max(ttl_s, pins[tenant].ttl_s)
        else:
            pool_room = self.budget - len(self) + bool(pins)  # a page pinned already costs the pool nothing
            if min(self.tenant_budget - self.by_tenant[tenant], pool_room) <= 0:
                self.refused += 1
                return False
            self._of_page[page] = pins
            self.by_tenant[tenant] += 1
        self._set(page, tenant, Pin(ttl_s, now + ttl_s))
        return True

    def renew(self, page: int, now: float) -> None:
        """A hit on page: every pin on it lasts its TTL from now."""
        for tenant, pin in self._of_page.get(page, {}).items():
            self._set(page, tenant, Pin(pin.ttl_s, now + pin.ttl_s))

    def expire(self, now: float) -> list[int]:
        """End the pins due by now; the pages left with no pin."""
        unpinned = []
        while self._heap and self._heap[0][0] <= now:
            expires, page, tenant = heapq.heappop(self._heap)
            pins = self._of_page.get(page)
            if pins is None or tenant not in pins or pins[tenant].expires != expires:
                continue  # renewed, or dropped with its page
            del pins[tenant]
            self._charge_off(tenant)
            if not pins:
                del self._of_page[page]
                unpinned.append(page)
        return unpinned

    def drop(self, page: int) -> None:
        """The page leaves the cache (flushed, or its publisher distrusted): its pins go with it."""
        for tenant in self._of_page.pop(page, {}):
            self._charge_off(tenant)

    def _set(self, page: int, tenant: str, pin: Pin) -> None:
        self._of_page[page][tenant] = pin
        heapq.heappush(self._heap, (pin.expires, page, tenant))
        live = sum(self.by_tenant.values())
        if len(self._heap) > 4 * live + 1024:  # renewals of hot pins left stale entries: drop them
            self._heap = [(p.expires, pg, t) for pg, pins in self._of_page.items() for t, p in pins.items()]
            heapq.heapify(self._heap)

    def _charge_off(self, tenant: str) -> None:
        self.by_tenant[tenant] -= 1
        if not self.by_tenant[tenant]:
            del self.by_tenant[tenant]
