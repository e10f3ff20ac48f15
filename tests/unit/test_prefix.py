"""The hash chain over token ids, and the prefix index's LRU order."""

from __future__ import annotations

from memory_daemon.prefix import KEY_BYTES, PrefixIndex, page_keys


def test_keys_cover_full_pages_only() -> None:
    assert len(page_keys(list(range(47)), page_size=16)) == 2
    assert len(page_keys(list(range(48)), page_size=16)) == 3
    assert page_keys(list(range(15)), page_size=16) == []
    assert all(len(key) == KEY_BYTES for key in page_keys(list(range(48)), 16))


def test_a_key_depends_on_every_earlier_token() -> None:
    base = page_keys(list(range(48)), page_size=16)
    changed = list(range(48))
    changed[3] = 999  # in the first page
    other = page_keys(changed, page_size=16)
    assert all(a != b for a, b in zip(base, other, strict=True))
    changed = list(range(48))
    changed[40] = 999  # in the last page
    assert page_keys(changed, 16)[:2] == base[:2] and page_keys(changed, 16)[2] != base[2]


def test_the_chain_can_be_continued_from_a_parent() -> None:
    tokens = list(range(64))
    whole = page_keys(tokens, 16)
    assert page_keys(tokens[32:], 16, parent=whole[1]) == whole[2:]


def test_the_index_refuses_a_second_page_for_a_key_and_evicts_oldest_idle_first() -> None:
    index = PrefixIndex()
    assert index.add("m", b"k1", 5)
    assert not index.add("m", b"k1", 6)
    assert index.add("m", b"k2", 6)
    assert index.add("other", b"k1", 7)
    for page in (6, 5, 7):
        index.mark_idle(page)
    index.mark_busy(5)
    assert (index.cached_pages, index.evictable_pages) == (3, 2)
    assert index.oldest_idle() == 6
    index.remove(6)
    assert index.get("m", b"k2") is None
    assert index.oldest_idle() == 7
    index.remove(7)
    assert index.oldest_idle() is None  # page 5 is busy
    assert index.get("m", b"k1") == 5
