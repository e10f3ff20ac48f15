"""The prefix index: full pages keyed by a hash chain over their token ids, with an LRU of idle pages.

A page's key hashes its parent's key with the page's token ids, so equal keys mean equal prefixes up to
and including that page. The index is namespaced by model id: workers of two models that happen to share
a pool shape never see each other's pages.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from memory_daemon.prefix_events import ModelEvents, Stored

ROOT_KEY = b""  # the chain's parent for an unsalted prompt
KEY_BYTES = 16
MAX_KEY_BYTES = 64


class Published(NamedTuple):
    """A page offered to the index: its chain key, and for the index's events its parent and tokens."""

    key: bytes
    page: int
    parent: bytes = ROOT_KEY
    token_ids: tuple[int, ...] = ()


def salted_root(salt: str) -> bytes:
    """The chain's parent for a request's cache salt: salted chains never meet unsalted ones or each other."""
    if not salt:
        return ROOT_KEY
    return hashlib.blake2b(salt.encode(), digest_size=KEY_BYTES, person=b"pagedserve-salt").digest()


def page_keys(token_ids: Sequence[int], page_size: int, parent: bytes = ROOT_KEY) -> list[bytes]:
    """The chain keys of every full page of token_ids, continuing the chain from parent."""
    keys = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        chunk = array("I", token_ids[start : start + page_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


class Entry(NamedTuple):
    """An indexed page: whose it is, its key, and its parent's key and tokens (what a lower tier keeps)."""

    model_id: str
    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]


class PrefixIndex:
    """(model id, key) -> page, plus the least-recently-used order of pages no one references, and each
    model's record of what entered and left (`prefix_events`)."""

    def __init__(self) -> None:
        self._page_by_key: dict[tuple[str, bytes], int] = {}
        self._entry_of: dict[int, Entry] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.events: dict[str, ModelEvents] = {}

    def events_of(self, model_id: str) -> ModelEvents:
        if model_id not in self.events:
            self.events[model_id] = ModelEvents()
        return self.events[model_id]

    def commit(self) -> None:
        """Close the changes so far into one numbered batch per model."""
        for events in self.events.values():
            events.commit()

    @property
    def cached_pages(self) -> int:
        return len(self._entry_of)

    @property
    def evictable_pages(self) -> int:
        return len(self._idle)

    def get(self, model_id: str, key: bytes) -> int | None:
        return self._page_by_key.get((model_id, key))

    def add(
        self, model_id: str, key: bytes, page: int, parent: bytes = ROOT_KEY, token_ids: Sequence[int] = ()
    ) -> bool:
        """Index page under key; False when the key already names another page."""
        assert page not in self._entry_of, f"page {page} is indexed twice"
        if (model_id, key) in self._page_by_key:
            return False
        self._page_by_key[(model_id, key)] = page
        self._entry_of[page] = Entry(model_id, key, parent, tuple(token_ids))
        self.events_of(model_id).stored(Stored(key, parent, tuple(token_ids)))
        return True

    def __contains__(self, page: int) -> bool:
        return page in self._entry_of

    def entry(self, page: int) -> Entry:
        return self._entry_of[page]

    def mark_idle(self, page: int) -> None:
        """Its last reference is gone: it becomes the most recently used evictable page."""
        self._idle[page] = None

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def mark_busy(self, page: int) -> None:
        self._idle.pop(page, None)

    def oldest_idle(self) -> int | None:
        """The least recently used idle page, the next to evict; None if there is none."""
        return next(iter(self._idle), None)

    def pages(self) -> list[int]:
        """Every indexed page, in the order they were indexed."""
        return list(self._entry_of)

    def idle_pages_in_order(self) -> list[int]:
        """The idle pages, least recently used first."""
        return list(self._idle)

    def idle_pages(self, model_id: str) -> list[int]:
        return [page for page in self._idle if self._entry_of[page].model_id == model_id]

    def remove(self, page: int) -> None:
        """Drop an indexed page from the index (and from the idle order): no lookup finds it again."""
        self._idle.pop(page, None)
        self._drop(page)

    def _drop(self, page: int) -> None:
        entry = self._entry_of.pop(page)
        del self._page_by_key[(entry.model_id, entry.key)]
        self.events[entry.model_id].removed(entry.key)
