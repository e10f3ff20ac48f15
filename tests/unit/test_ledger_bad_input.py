"""The page ledger refuses bad input whole: the counts do not move. The `ledger` fixture
(tests/unit/conftest.py) is a pool of the null page and pages 1..8.
"""

from __future__ import annotations

import pytest

from memory_daemon.ledger import PageLedger
from pagedserve.plumbing.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from tests.unit.ledgers import KEYS

# Bad input: every call below is refused whole, and the counts do not move.


def _assert_unchanged(ledger: PageLedger, before: object) -> None:
    assert ledger.counts() == before
    ledger.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"release": [5]}, FailedPrecondition, "page 5: it is already free (a double free?)"),
        ({"release": [1, 1]}, FailedPrecondition, "cannot release page 1 twice"),
        (
            {"release": [3]},
            PermissionDenied,
            "page 3: it is leased to worker 'other' (id 2), not to worker 'w'",
        ),
        ({"release": [0]}, InvalidArgument, "page 0 is the null page"),
        ({"release": [99]}, InvalidArgument, "page 99 is out of range: this pool's pages are 1..8"),
        (
            {"release": [2]},
            FailedPrecondition,
            "page 2: it is shared, not leased; drop your reference with unref",
        ),
        (
            {"unref": [1]},
            FailedPrecondition,
            "cannot unref page 1: it is leased, not shared; release it instead",
        ),
        (
            {"unref": [2, 2]},
            FailedPrecondition,
            "unref page 2 2 time(s): worker 'w' (id 1) holds 1 reference(s)",
        ),
        (
            {"publish": [(KEYS[1], 3)]},
            PermissionDenied,
            "cannot publish page 3: it is leased to worker 'other'",
        ),
        ({"publish": [(b"", 1)]}, InvalidArgument, "a page key must be 1 to 64 bytes, got 0"),
        ({"publish": [(KEYS[1], 1)], "release": [1]}, FailedPrecondition, "both published and released"),
        ({"release": [1], "unref": [9]}, InvalidArgument, "page 9 is out of range"),
    ],
)
def test_bad_updates_are_refused_whole(kwargs: dict, error: type[Exception], message: str) -> None:
    ledger = PageLedger(9)
    worker, other = ledger.open_lease("w", "m"), ledger.open_lease("other", "m")
    ledger.grant(worker, 2)  # pages 1, 2
    ledger.grant(other, 1)  # page 3
    ledger.update(worker, publish=[(KEYS[0], 2)])
    before = ledger.counts()
    with pytest.raises(error) as caught:
        ledger.update(worker, **kwargs)
    assert message in str(caught.value)
    _assert_unchanged(ledger, before)


def test_publish_then_unref_in_one_batch_is_valid(ledger: PageLedger) -> None:
    worker = ledger.open_lease("w", "m")
    ledger.grant(worker, 1)
    ledger.update(worker, publish=[(KEYS[0], 1)], unref=[1])
    assert ledger.counts().evictable_pages == 1
    ledger.check_invariants()


@pytest.mark.parametrize(
    ("need", "consumed", "idle"), [(-1, 0, 0), (9, 0, 0), (0, -5, 0), (0, 0, 10**9), (10**12, 0, 0)]
)
def test_absurd_refill_sizes_are_refused(ledger: PageLedger, need: int, consumed: int, idle: int) -> None:
    worker = ledger.open_lease("w", "m")
    before = ledger.counts()
    with pytest.raises(InvalidArgument, match="must be between 0 and the pool's 8 pages"):
        ledger.refill(worker, need, consumed, idle)
    _assert_unchanged(ledger, before)


def test_too_many_lookup_keys_are_refused(ledger: PageLedger) -> None:
    with pytest.raises(InvalidArgument, match="20 keys is more than the pool's 8 pages"):
        ledger.lookup(ledger.open_lease("w", "m"), [b"k"] * 20)


def test_a_pool_needs_two_pages() -> None:
    with pytest.raises(InvalidArgument, match="at least 2 pages"):
        PageLedger(1)
