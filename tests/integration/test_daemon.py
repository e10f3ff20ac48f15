"""The memory daemon as a real process, with real worker processes attached over real sockets."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from memory_daemon.stats import PoolCounts
from memory_daemon.wire import counts_from_pb, shape_to_pb
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from tests.clients import internal_channel
from tests.integration.kv_agent import SHAPE
from tests.procs import DaemonProcess, KVAgent, free_port, start_daemon
from tests.waiting import wait_until


@pytest.fixture
def stub(daemon: DaemonProcess) -> Iterator[memory_pb2_grpc.MemoryDaemonStub]:
    with internal_channel(daemon.address) as channel:
        yield memory_pb2_grpc.MemoryDaemonStub(channel)


@pytest.fixture
def agents(daemon: DaemonProcess) -> Iterator[Callable[[str], KVAgent]]:
    started: list[KVAgent] = []

    def start(name: str, **kwargs: object) -> KVAgent:
        started.append(KVAgent(daemon.address, name, **kwargs))
        return started[-1]

    yield start
    for agent in started:
        agent.kill()


def pool_counts(stub: memory_pb2_grpc.MemoryDaemonStub) -> PoolCounts:
    (pool,) = stub.GetStats(memory_pb2.GetStatsRequest()).pools
    return counts_from_pb(pool)


def test_two_workers_share_one_pool_and_a_killed_worker_returns_its_pages(
    daemon: DaemonProcess, stub: memory_pb2_grpc.MemoryDaemonStub, agents: Callable[..., KVAgent]
) -> None:
    a, b = agents("a"), agents("b")
    assert a("info")["shape"] == b("info")["shape"] == [3, 2, 64, 4, 2, 8]
    (pool_file,) = daemon.shm_dir.iterdir()

    # Data written by one worker process is read by the other: one zero-copy pool.
    pages_a = a("allocate", n=3)
    a("write", pages=pages_a, value=7.0)
    assert b("read", pages=pages_a) == [7.0, 7.0, 7.0]
    pages_b = b("allocate", n=2)
    b("write", pages=pages_b, value=-3.5)
    assert a("read", pages=pages_b) == [-3.5, -3.5]
    assert not set(pages_a) & set(pages_b)

    # a publishes a two-page prompt prefix, then is SIGKILLed mid-flight.
    assert a("publish", tokens=list(range(8)), pages=pages_a[:2]) == 2
    before = pool_counts(stub)
    leased_by = {w.name: w.leased_pages for w in before.workers}
    assert before.leased_pages == leased_by["a"] + leased_by["b"]
    a.kill()
    killed = time.monotonic()
    wait_until(
        lambda: len(pool_counts(stub).workers) == 1,
        5.0,
        lambda: f"the daemon to drop the killed worker: {pool_counts(stub)}",
    )
    took = time.monotonic() - killed
    after = pool_counts(stub)
    assert after.leased_pages == leased_by["b"]
    assert (after.cached_pages, after.evictable_pages, after.shared_pages) == (2, 2, 2)
    assert after.free_pages == after.total_pages - leased_by["b"] - 2
    print(f"a SIGKILLed worker's {leased_by['a']} leased pages came back in {took * 1000:.0f} ms")

    # Its published pages outlived it, data and all.
    found = b("lookup", tokens=[*range(8), 99, 100])
    assert found == pages_a[:2]
    assert b("read", pages=found) == [7.0, 7.0]
    assert pool_file.exists(), "a worker's exit must not unlink the pool (resource_tracker)"

    b("free", pages=pages_b + found)
    assert b.close() == 0
    wait_until(
        lambda: not pool_counts(stub).workers, 5.0, lambda: f"every worker to detach: {pool_counts(stub)}"
    )
    final = pool_counts(stub)
    assert final.settled and final.cached_pages == 2 and final.prefix_hits == 1


def test_an_idle_worker_returns_pages_when_another_runs_short(
    stub: memory_pb2_grpc.MemoryDaemonStub, agents: Callable[..., KVAgent]
) -> None:
    a, b = agents("a"), agents("b")
    a("free", pages=a("allocate", n=8))  # a now sits on idle pages
    idle_a = a("usage")["idle_pages"]
    free = pool_counts(stub).free_pages
    assert idle_a > 0
    assert b("allocate", n=free + 1) is None  # short by one: the daemon asks a to give some back
    wait_until(  # a's release reached the daemon
        lambda: pool_counts(stub).free_pages > free,
        5.0,
        lambda: f"more than {free} free pages: {pool_counts(stub)}",
    )
    assert a("usage")["idle_pages"] < idle_a
    assert len(b("allocate", n=free + 1)) == free + 1


OTHER_SHAPE = memory_pb2.PoolShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")


def attach_request(**overrides: object) -> memory_pb2.AttachRequest:
    fields: dict = {
        "worker_name": "raw",
        "model_id": "test-model",
        "shape": shape_to_pb(SHAPE),
        "num_pages": 64,
    }
    fields.update(overrides)
    return memory_pb2.AttachRequest(**fields)


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


Shape, C = memory_pb2.PoolShape, grpc.StatusCode
BAD_ATTACHES = [  # (request, status, words of its message)
    (attach_request(shape=Shape(num_layers=5, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)),
     C.FAILED_PRECONDITION, "model 'test-model' is registered with shape (3 layers"),
    (attach_request(shape=Shape(num_layers=0, num_kv_heads=2, head_dim=8, dtype="float32")),
     C.INVALID_ARGUMENT, "num_layers must be between 1 and 1024, got 0"),
    (attach_request(shape=Shape(num_layers=2, num_kv_heads=2, head_dim=8, dtype="int8")),
     C.INVALID_ARGUMENT, "dtype must be one of float32, float16, bfloat16, got 'int8'"),
    (attach_request(model_id="huge", shape=OTHER_SHAPE, num_pages=10**9), C.RESOURCE_EXHAUSTED,
     "budget is left; ask for fewer pages or start the daemon with a larger --max-memory"),
    (attach_request(model_id="tiny", shape=OTHER_SHAPE, memory_bytes=100), C.INVALID_ARGUMENT,
     "this registration gives 0"),
    (attach_request(model_id=""), C.INVALID_ARGUMENT, "model_id is empty"),
    (attach_request(device="cuda"), C.FAILED_PRECONDITION, "start the daemon with --device cuda"),
]  # fmt: skip


def test_bad_input_gets_a_clear_status_and_changes_nothing(
    daemon: DaemonProcess, stub: memory_pb2_grpc.MemoryDaemonStub
) -> None:
    mine = stub.Attach(attach_request(worker_name="mine"))
    theirs = stub.Attach(attach_request(worker_name="theirs"))
    lease = next(mine).attached.lease_id
    other = next(theirs).attached.lease_id
    my_pages = list(stub.Lease(memory_pb2.LeaseRequest(lease_id=lease, need=2)).pages)
    their_pages = list(stub.Lease(memory_pb2.LeaseRequest(lease_id=other, need=1)).pages)
    before = pool_counts(stub)

    C = grpc.StatusCode
    free_page = next(p for p in range(1, 64) if p not in my_pages + their_pages)
    Lease, Update, Lookup = memory_pb2.LeaseRequest, memory_pb2.UpdateRequest, memory_pb2.LookupRequest
    Pin, CheckPins = memory_pb2.PinRequest, memory_pb2.CheckPinsRequest
    bad_calls = [
        ("Lease", Lease(lease_id="no-such-lease", need=1), C.NOT_FOUND,
         "unknown lease 'no-such-lease': attach first"),
        ("Update", Update(lease_id=lease, release=[free_page]), C.FAILED_PRECONDITION,
         f"cannot release page {free_page}: it is already free (a double free?)"),
        ("Update", Update(lease_id=lease, release=[my_pages[0], my_pages[0]]), C.FAILED_PRECONDITION,
         "twice in one update"),
        # A good publish beside the bad release: nothing is applied before everything is checked.
        ("Update", Update(lease_id=lease, publish=[memory_pb2.PublishedPage(key=b"k", page=my_pages[1])],
                          release=[free_page]), C.FAILED_PRECONDITION,
         f"cannot release page {free_page}: it is already free"),
        ("Update", Update(lease_id=lease, release=their_pages), C.PERMISSION_DENIED,
         f"cannot release page {their_pages[0]}: it is leased to worker 'theirs'"),
        ("Update", Update(lease_id=lease, release=[10**6]), C.INVALID_ARGUMENT,
         "page 1000000 is out of range: this pool's pages are 1..63"),
        ("Update", Update(lease_id=lease, unref=[my_pages[0]]), C.FAILED_PRECONDITION,
         "it is leased, not shared; release it instead"),
        ("Lease", Lease(lease_id=lease, need=10**9), C.INVALID_ARGUMENT,
         "need must be between 0 and the pool's 63 pages, got 1000000000"),
        ("Lease", Lease(lease_id=lease, need=-1), C.INVALID_ARGUMENT, "need must be between 0"),
        ("LookupPrefix", Lookup(lease_id=lease, keys=[b"k"] * 100), C.INVALID_ARGUMENT,
         "100 keys is more than the pool's 63 pages"),
        ("Update", Update(lease_id=lease, publish=[memory_pb2.PublishedPage(key=b"k", page=my_pages[0])],
                          pin=[Pin(keys=[b"k"], ttl_seconds=10**6, tenant="t")]), C.INVALID_ARGUMENT,
         "cache_ttl_seconds is 1000000; a pin lasts 0 (none) to 86400 seconds"),
        ("Update", Update(lease_id=lease, pin=[Pin(keys=[b"k"], ttl_seconds=60, tenant="t" * 300)]),
         C.INVALID_ARGUMENT, "a pin's tenant must be 1 to 256 bytes, got 300"),
        ("PrefetchPrefix", memory_pb2.PrefetchRequest(lease_id=lease, keys=[b"k"] * 64), C.INVALID_ARGUMENT,
         "64 keys is more than the pool's 63 pages"),
        ("CheckPins", CheckPins(lease_id="no-such-lease", tenant="t", pages=1), C.NOT_FOUND, "unknown lease"),
        ("CheckPins", CheckPins(lease_id=lease, tenant="t", pages=-1), C.INVALID_ARGUMENT,
         "pages must be at least 0, got -1"),
        ("CheckPins", CheckPins(lease_id=lease, tenant="t", pages=1, keys=[b"k", b"l"]), C.INVALID_ARGUMENT,
         "2 keys for 1 pages: a key names one of the pages"),
        ("CheckPins", CheckPins(lease_id=lease, tenant="t", pages=1, keys=[b""]), C.INVALID_ARGUMENT,
         "a page key must be 1 to"),
        ("CheckPins", CheckPins(lease_id=lease, tenant="t", pages=10**9), C.RESOURCE_EXHAUSTED,
         "tenant 't' has pinned 0 of the 6 pages allowed in pool 1 (--tenant-pin-share 0.1 of its pages)"),
    ]  # fmt: skip
    for method, request, code, message in bad_calls:
        error = rpc_error(lambda method=method, request=request: getattr(stub, method)(request))
        assert (error.code(), message in error.details()) == (code, True), error.details()
    for request, code, message in BAD_ATTACHES:
        error = rpc_error(lambda request=request: next(stub.Attach(request)).attached.lease_id)
        assert (error.code(), message in error.details()) == (code, True), error.details()

    assert pool_counts(stub) == before  # nothing moved, and no pool was created for the refused shapes
    assert len(stub.GetStats(memory_pb2.GetStatsRequest()).pools) == 1
    mine.cancel()
    theirs.cancel()
    wait_until(lambda: pool_counts(stub).settled, 5.0, lambda: f"the pool to settle: {pool_counts(stub)}")


def test_a_large_cached_state_reaches_a_watcher_that_reads_messages_of_4_mib(run_dir: Path) -> None:
    """SMG reads a message of 4 MiB at most, and the state of 80,000 cached pages takes more as one batch:
    it comes in parts, numbered one after another up to the last batch, and the next batch follows on."""
    pages = 80_000
    daemon = start_daemon(run_dir, "--pool-memory", f"{(pages + 1024) * SHAPE.page_bytes}")
    agent = KVAgent(daemon.address, "many", num_pages=pages + 1024)
    try:
        held = agent("allocate", n=pages)
        assert agent("publish", pages=held, tokens=list(range(pages * SHAPE.page_size))) == pages
        with internal_channel(daemon.address, [("grpc.max_receive_message_length", 4 * 2**20)]) as channel:
            stub = memory_pb2_grpc.MemoryDaemonStub(channel)
            request = memory_pb2.WatchPrefixIndexRequest(model_id="test-model", after_sequence=0)
            stream = stub.WatchPrefixIndex(request, timeout=60)
            parts = [next(stream)]
            while sum(len(part.changes) for part in parts) < pages + 1:  # a clear, then every page
                parts.append(next(stream))
            last = parts[-1].sequence
            assert [part.sequence for part in parts] == list(range(last - len(parts) + 1, last + 1))
            assert parts[0].changes[0].cleared and len(parts) > 1
            stored = {change.stored.key for part in parts for change in part.changes if change.stored.key}
            assert len(stored) == pages
            (more,) = agent("allocate", n=1)  # one page more: the next batch, numbered on
            agent(
                "publish",
                pages=[more],
                tokens=list(range(pages * SHAPE.page_size, (pages + 1) * SHAPE.page_size)),
            )
            assert next(stream).sequence == last + 1
            stream.cancel()
    finally:
        agent.kill()
        assert daemon.stop() == 0, daemon.log()


def test_a_daemon_removes_files_a_dead_daemon_left(run_dir: Path) -> None:
    shm_dir = Path(tempfile.mkdtemp(prefix="pagedserve-test-", dir="/dev/shm"))
    stale = shm_dir / "pagedserve-kv-999999999-1.bin"
    stale.write_bytes(b"\0" * 4096)
    ours = shm_dir / f"pagedserve-kv-{os.getpid()}-1.bin"  # a live process's pool: left alone
    ours.write_bytes(b"\0")
    process = start_daemon(run_dir, shm_dir=shm_dir)
    try:
        assert not stale.exists() and ours.exists()
    finally:
        assert process.stop() == 0
        shutil.rmtree(shm_dir)


def test_the_console_entry_point_serves_on_loopback_tcp(run_dir: Path) -> None:
    port = free_port()
    entry = (str(Path(sys.executable).parent / "pagedserve"), "daemon")
    process = start_daemon(run_dir, address=f"127.0.0.1:{port}", entry=entry)
    try:
        agent = KVAgent(f"127.0.0.1:{port}", "tcp-worker")
        assert len(agent("allocate", n=4)) == 4
        assert agent.close() == 0
        assert "memory daemon serving on 127.0.0.1:" in process.log()
    finally:
        assert process.stop() == 0
        assert not list(process.shm_dir.iterdir())
        shutil.rmtree(process.shm_dir)


def status_at_end(stream: Iterator[object]) -> tuple[grpc.StatusCode, str]:
    """Read a stream to its end: its status and details."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_a_sigterm_ends_every_lease_and_index_watch_saying_why(run_dir: Path) -> None:
    """The daemon ends its endless streams itself before its server stops; the stop used to cancel them,
    which the other side read as "Cancelling all calls" and grpc logged as the daemon's unhandled
    CancelledError, with a traceback."""
    daemon = start_daemon(run_dir)
    with internal_channel(daemon.address) as channel:
        stub = memory_pb2_grpc.MemoryDaemonStub(channel)
        attach = memory_pb2.AttachRequest(
            worker_name="w", model_id="test-model", shape=shape_to_pb(SHAPE), device="cpu", num_pages=16
        )
        lease = stub.Attach(attach, timeout=60)
        assert next(lease).HasField("attached")
        watch = memory_pb2.WatchPrefixIndexRequest(model_id="test-model", after_sequence=0)
        index = stub.WatchPrefixIndex(watch, timeout=60)
        assert next(index).changes[0].cleared
        assert daemon.stop() == 0
        stopping = (grpc.StatusCode.UNAVAILABLE, "the memory daemon is shutting down")
        assert status_at_end(lease) == stopping
        assert status_at_end(index) == stopping
    assert "Traceback" not in daemon.log()
