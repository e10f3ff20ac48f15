"""The scheduler's prefix caching on admission: published pages found, references taken and dropped
(tests/unit/scheduling.py drives it step by step without a model).
"""

from __future__ import annotations

from services.worker.core.sequence import FinishReason, Status
from tests.unit.scheduling import (
    assert_settled,
    held_pages,
    make_kv,
    make_scheduler,
    make_seq,
    prompt,
    run_until_idle,
    step,
)

# Prefix caching on admission -------------------------------------------------------------------------


def test_admission_reuses_published_prefix_pages() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv)
    first = make_seq("first", prompt(10), max_tokens=2, arrival=0)  # two full pages and two tokens
    scheduler.add(first)
    assert step(scheduler).items == [("first", 0, 10, True)]
    first_pages = first.pages[:2]
    scheduler.finish(first, FinishReason.STOP)  # its published pages stay cached
    assert first.cached_prompt_tokens == 0
    assert kv.stats().cached_pages == 2

    second = make_seq("second", [*prompt(10), 50, 51, 52], max_tokens=2, arrival=1)
    scheduler.add(second)
    assert step(scheduler).items == [("second", 8, 5, True)]  # the third page differs: 2 pages found
    assert (second.cached_prompt_tokens, second.num_computed, len(second.pages)) == (8, 13, 4)
    assert second.pages[:2] == first_pages  # the very pages "first" published
    assert second.num_shared == 3  # the two found, and its own third page once computed
    counts = kv.stats()
    assert (counts.prefix_lookups, counts.prefix_hits, counts.prefix_hit_pages) == (2, 1, 2)
    assert [s.items for s in run_until_idle(scheduler)] == [[("second", 13, 1, True)]]
    assert_settled(kv)


def test_a_prompt_of_whole_pages_leaves_its_last_page_to_compute() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv)
    scheduler.add(make_seq("first", prompt(12), max_tokens=1, arrival=0))
    run_until_idle(scheduler)
    assert kv.stats().cached_pages == 3

    again = make_seq("again", prompt(12), max_tokens=1, arrival=1)  # every page is cached
    scheduler.add(again)
    assert step(scheduler).items == [("again", 8, 4, True)]  # the last page is computed, to sample from
    assert again.cached_prompt_tokens == 8

    page = make_seq("page", prompt(4), max_tokens=1, arrival=2)  # one page: nothing may match
    scheduler.add(page)
    lookups = kv.stats().prefix_lookups
    assert step(scheduler).items == [("page", 0, 4, True)]
    assert (page.cached_prompt_tokens, kv.stats().prefix_lookups) == (0, lookups)  # not even looked up
    assert_settled(kv)


def test_without_prefix_caching_nothing_is_published_or_matched() -> None:
    kv = make_kv(16)
    scheduler = make_scheduler(kv, prefix_caching=False)
    scheduler.add(make_seq("first", prompt(10), max_tokens=1, arrival=0))
    run_until_idle(scheduler)
    second = make_seq("second", prompt(10), max_tokens=1, arrival=1)
    scheduler.add(second)

    assert step(scheduler).items == [("second", 0, 10, True)]
    assert (second.cached_prompt_tokens, second.num_shared) == (0, 0)
    counts = kv.stats()
    assert (counts.prefix_lookups, counts.cached_pages, counts.shared_pages) == (0, 0, 0)
    assert_settled(kv)


def test_a_sequence_that_cannot_be_admitted_drops_its_prefix_references() -> None:
    kv = make_kv(4)
    scheduler = make_scheduler(kv)
    scheduler.add(make_seq("seed", prompt(8), max_tokens=1, arrival=0))
    run_until_idle(scheduler)  # two cached pages, evictable
    hog = make_seq("hog", prompt(7, first=100), max_tokens=2, arrival=1)
    scheduler.add(hog)
    assert step(scheduler).items == [("hog", 0, 7, True)]  # the two free pages: "seed"'s stay cached

    reuse = make_seq("reuse", [*prompt(8), 60, 61, 62, 63, 64], max_tokens=1, arrival=2)
    scheduler.add(reuse)
    blocked = step(scheduler)  # "reuse" finds the 2 cached pages but needs 2 more: none is left
    assert (blocked.items, blocked.done) == ([("hog", 7, 1, True)], ["hog"])
    assert (reuse.status, reuse.pages, reuse.num_computed) == (Status.WAITING, [], 0)
    assert held_pages(kv) == 0  # it does not sit on the cached pages while it waits
    assert kv.stats().evictable_pages == 4  # "seed"'s two and "hog"'s two

    assert [s.items for s in run_until_idle(scheduler)] == [[("reuse", 8, 5, True)]]
    assert reuse.cached_prompt_tokens == 8
    assert_settled(kv)
