"""The prefix index's events, as the daemon records them for a gateway: what each ledger call stores and
removes, numbered one batch per call; the whole state for a new subscriber; replay from a cursor; and the
statuses (OutOfRange, DataLoss) that tell a subscriber to start over."""

from __future__ import annotations

import asyncio

import pytest
from smg_grpc_proto.generated import common_pb2

from memory_daemon import prefix_events
from memory_daemon.ledger import PageLedger
from memory_daemon.prefix import Published, salted_root
from memory_daemon.prefix_events import DISK, HOST, MAX_BEHIND, Batch, Cleared, ModelEvents, Removed, Stored
from memory_daemon.wire import batch_to_pb
from pagedserve.plumbing.errors import DataLoss, OutOfRange
from services.frontend.node_cache import NodeCache, block_hash
from tests.unit.ledgers import KEYS

TOKENS = [tuple(range(i * 16, (i + 1) * 16)) for i in range(4)]


def publish_chain(ledger: PageLedger, count: int, model: str = "m") -> list[int]:
    worker = ledger.open_lease("w", model)
    pages = ledger.grant(worker, count) or []
    parents = [b"", *KEYS[: count - 1]]
    ledger.update(worker, publish=[Published(KEYS[i], pages[i], parents[i], TOKENS[i]) for i in range(count)])
    ledger.update(worker, unref=pages)  # idle, so evictable
    return pages


def drain(events: ModelEvents, after: int) -> list[Batch]:
    subscription = events.subscribe(after)
    batches = []
    while not subscription._queue.empty():
        batches.append(asyncio.run(subscription.next()))
    subscription.close()
    return batches


def test_a_new_subscriber_gets_the_whole_state_parents_first_then_each_call_as_one_batch() -> None:
    ledger = PageLedger(9)
    publish_chain(ledger, 3)
    events = ledger.index.events_of("m")
    (state,) = drain(events, 0)
    assert state.changes == (
        Cleared(),
        Stored(KEYS[0], b"", TOKENS[0]),
        Stored(KEYS[1], KEYS[0], TOKENS[1]),
        Stored(KEYS[2], KEYS[1], TOKENS[2]),
    )
    subscription = events.subscribe(state.sequence)
    assert ledger.flush("m") == 3  # idle cached pages go free
    batch = asyncio.run(subscription.next())
    assert batch.sequence == state.sequence + 1
    assert sorted(c.key for c in batch.changes if isinstance(c, Removed)) == sorted(KEYS[:3])
    assert ledger.free_pages == 8
    ledger.check_invariants()


def test_the_history_replays_from_a_cursor_and_numbers_run_without_gaps() -> None:
    ledger = PageLedger(9)
    first = ledger.index.events_of("m").sequence  # the opening batch: nothing cached
    publish_chain(ledger, 2)
    ledger.flush("m")
    batches = drain(ledger.index.events_of("m"), first)
    assert [b.sequence for b in batches] == [first + 1, first + 2]
    assert [type(c) for c in batches[0].changes] == [Stored, Stored]
    assert [type(c) for c in batches[1].changes] == [Removed, Removed]


def test_eviction_and_drop_published_are_announced() -> None:
    ledger = PageLedger(9)
    publish_chain(ledger, 4)
    events = ledger.index.events_of("m")
    after = events.sequence
    other = ledger.open_lease("other", "m")
    assert ledger.grant(other, 6, need=6) is not None  # 4 free pages, so 2 cached ones are evicted
    (evicted,) = drain(events, after)
    assert [c.key for c in evicted.changes] == KEYS[:2]  # least recently used first
    assert ledger.drop_published(name="w") == 2
    (dropped,) = drain(events, evicted.sequence)
    assert [c.key for c in dropped.changes] == KEYS[2:4]
    ledger.check_invariants()


def test_pages_without_tokens_are_not_announced() -> None:
    """A salted prompt's pages are published without their tokens: only the salt's requests may find them."""
    ledger = PageLedger(9)
    worker = ledger.open_lease("w", "m")
    (page,) = ledger.grant(worker, 1) or []
    events = ledger.index.events_of("m")
    after = events.sequence
    ledger.update(worker, publish=[Published(KEYS[0], page, salted_root("s"))])
    assert drain(events, after) == []
    assert ledger.drop_published(name="w") == 1
    assert drain(events, after) == []


def test_each_model_has_its_own_events() -> None:
    ledger = PageLedger(9)
    publish_chain(ledger, 1, model="a")
    (state,) = drain(ledger.index.events_of("b"), 0)
    assert state.changes == (Cleared(),)


def test_a_cursor_the_history_lacks_is_out_of_range() -> None:
    clock = iter([1000.0, 1000.0, 1000.0])
    events = ModelEvents(lambda: next(clock))
    assert events.sequence == 1_000_000_000  # from the start time in microseconds
    for cursor in (1, 999_999_998, events.sequence + 1):  # another daemon's life, too old, from the future
        with pytest.raises(OutOfRange, match="subscribe from 0"):
            events.subscribe(cursor)


def test_a_subscriber_that_falls_far_behind_gets_data_loss() -> None:
    events = ModelEvents()
    subscription = events.subscribe(events.sequence)
    for i in range(MAX_BEHIND + 1):
        events.stored(Stored(i.to_bytes(8, "little"), b"", (i,)))
        events.commit()
    assert subscription not in events.subscribers  # it gets no more batches
    with pytest.raises(DataLoss):
        for _ in range(MAX_BEHIND + 1):
            asyncio.run(subscription.next())


def test_a_gateway_reads_each_medium_as_its_kv_cache_tier() -> None:
    """What the frontend relays to SMG: the pool is the DEVICE tier, host memory HOST, the disk tier DISK,
    each with its raw medium string, for stored and removed blocks alike."""
    batch = Batch(7, 1.0, (Stored(KEYS[0], b"", TOKENS[0]), Stored(KEYS[0], b"", TOKENS[0], DISK),
                           Stored(KEYS[0], b"", TOKENS[0], HOST), Removed(KEYS[0]), Removed(KEYS[0], DISK),
                           Removed(KEYS[0], HOST)))  # fmt: skip
    events = NodeCache("unix:/nowhere", None, list)._to_smg(batch_to_pb(batch), 16).events
    tiers = [(getattr(e, e.WhichOneof("data")).tier, getattr(e, e.WhichOneof("data")).medium) for e in events]
    device, disk = common_pb2.KV_CACHE_TIER_DEVICE, common_pb2.KV_CACHE_TIER_DISK
    host = common_pb2.KV_CACHE_TIER_HOST
    assert tiers == [(device, "pool"), (disk, "disk"), (host, "host")] * 2
    assert events[1].stored.blocks[0].block_hash == block_hash(KEYS[0]) == events[4].removed.block_hashes[0]


def test_many_changes_and_a_large_state_go_out_in_batches_a_gateway_reads_one_after_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flush, or a restart's disk tier, changes more pages than SMG reads in one message: each batch is
    bounded on the wire, the daemon's and SMG's, and the numbers run on without a gap."""
    monkeypatch.setattr(prefix_events, "MAX_BATCH_BYTES", 2000)
    events = ModelEvents()
    keys = [i.to_bytes(16, "little") for i in range(1, 121)]
    stored = [Stored(key, keys[i - 1] if i else b"", tuple(range(i, i + 16))) for i, key in enumerate(keys)]
    removed = [Removed(key) for key in keys[60:]]
    subscription = events.subscribe(events.sequence)
    first = events.sequence + 1
    for change in stored:
        events.stored(change)
    events.commit()
    for change in removed:
        events.removed(change.key)
    events.commit()
    batches = [asyncio.run(subscription.next()) for _ in range(subscription._queue.qsize())]
    assert [batch.sequence for batch in batches] == list(range(first, first + len(batches)))
    assert [change for batch in batches for change in batch.changes] == [*stored, *removed]
    state = drain(events, 0)
    assert [part.sequence for part in state] == list(
        range(events.sequence - len(state) + 1, events.sequence + 1)
    )
    assert [change for part in state for change in part.changes] == [Cleared(), *stored[:60]]
    assert len(batches) > 4 and len(state) > 2
    smg = NodeCache("unix:/nowhere", None, list)
    for batch in (*batches, *state):
        wire = batch_to_pb(batch)
        assert max(wire.ByteSize(), smg._to_smg(wire, 16).ByteSize()) <= prefix_events.MAX_BATCH_BYTES
