"""The daemon's tiers on real processes: a daemon started with --kv-disk (and --kv-host-memory), worker
stand-ins attached over its socket (tests/integration/kv_agent.py), and the pages' bytes checked through the
workers' own maps of the pool. Evicted pages come back on a lookup, from host memory or from disk, also from
a daemon restarted after a SIGKILL; a file damaged on disk is refused and the chain stops there; the books
balance (`check_invariants`) at every step. Then the whole stack on the default model, with each tier."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from memory_daemon.disk_tier import TierCounts, file_name, fingerprint
from memory_daemon.prefix import page_keys
from memory_daemon.wire import counts_from_pb, tier_counts_from_pb
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.clients import Scrape, internal_channel, wait_for_every_page
from tests.integration.kv_agent import SHAPE
from tests.procs import DaemonProcess, KVAgent, start_daemon, start_stack
from tests.second_user import run_as_second_user
from tests.waiting import wait_until

PROMPT = list(range(12))  # three pages of SHAPE's four tokens
POOL_PAGES = 12


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "kv-disk"


def start(run_dir: Path, disk: Path, *extra: str) -> DaemonProcess:
    return start_daemon(run_dir, "--kv-disk", str(disk), "--kv-disk-size", "1MiB", *extra)


def checked_counts(daemon: DaemonProcess) -> memory_pb2.PoolStats:
    with internal_channel(daemon.address) as channel:
        stats = memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(
            memory_pb2.GetStatsRequest(check_invariants=True)
        )
    (pool,) = stats.pools
    return counts_from_pb(pool)


@pytest.fixture
def daemons(run_dir: Path) -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for daemon in started:
        daemon.kill()


def publish_prompt(
    daemon: DaemonProcess, device: str = "cpu", prompt: list[int] = PROMPT, first: int = 1
) -> None:
    """An agent writes the prompt's three pages (values first, first + 1, first + 2), publishes them and goes
    away."""
    writer = KVAgent(daemon.address, "writer", num_pages=POOL_PAGES, device=device)
    pages = writer("allocate", n=3)
    for value, page in enumerate(pages, start=first):
        writer("write", pages=[page], value=float(value))
    assert writer("publish", tokens=prompt, pages=pages) == 3
    writer("free", pages=pages)
    assert writer.close() == 0


def evict_everything(daemon: DaemonProcess, device: str = "cpu") -> None:
    """An agent takes every page the pool can give, which evicts every cached page, then goes away."""
    counts = checked_counts(daemon)
    hog = KVAgent(daemon.address, "hog", num_pages=POOL_PAGES, device=device)
    assert hog("allocate", n=counts.free_pages + counts.evictable_pages) is not None
    assert checked_counts(daemon).cached_pages == 0
    assert hog.close() == 0


def looked_up(daemon: DaemonProcess, device: str = "cpu", prompt: list[int] = PROMPT) -> list[float | None]:
    """What a fresh agent finds for the prompt (and a token past it): each found page's value."""
    reader = KVAgent(daemon.address, "reader", num_pages=POOL_PAGES, device=device)
    try:
        found = reader("lookup", tokens=[*prompt, 99])
        return reader("read", pages=found)  # type: ignore[return-value]
    finally:
        reader.close()


def prompt_on_disk(run_dir: Path, disk: Path) -> DaemonProcess:
    """A daemon whose pool had the prompt's pages, and evicted them to disk (its writer thread has written
    the three files)."""
    daemon = start(run_dir, disk)
    publish_prompt(daemon)
    evict_everything(daemon)
    wait_until(lambda: len(list(disk.glob("*.kvpage"))) == 3, 10, "the three evicted pages' files")
    return daemon


def restart(killed: DaemonProcess, disk: Path, tmp_path: Path) -> DaemonProcess:
    """A new daemon on the same disk folder, after killed was SIGKILLed (no chance to write anything)."""
    killed.kill()
    run_dir = tmp_path / "again"
    run_dir.mkdir(mode=0o700)
    return start(run_dir, disk)


def test_evicted_pages_come_back_from_disk_and_outlive_a_daemon_killed(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess], tmp_path: Path
) -> None:
    daemons.append(prompt_on_disk(run_dir, disk))
    assert looked_up(daemons[0]) == [1.0, 2.0, 3.0]
    after = checked_counts(daemons[0])
    assert (after.cached_pages, after.prefix_hit_pages) == (3, 3)
    assert {usage.name for usage in after.publishers} == {"writer"}  # who published them, as before

    daemons.append(restart(daemons[0], disk, tmp_path))
    assert looked_up(daemons[1]) == [1.0, 2.0, 3.0], "a warm restart serves the pages from disk"
    again = checked_counts(daemons[1])
    assert again.cached_pages == 3
    assert {usage.name for usage in again.publishers} == {"(a lower tier)"}  # the old daemon knew who


def test_a_graceful_stop_keeps_the_pools_cached_pages_for_the_next_daemon(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess], tmp_path: Path
) -> None:
    """Pages cached in the pool, never evicted, are written to the tier by a SIGTERM's stop: a new daemon
    on the folder serves them. A SIGKILL leaves only what was evicted (the test above)."""
    daemons.append(start(run_dir, disk))
    publish_prompt(daemons[0])
    assert not list(disk.glob("*.kvpage"))  # nothing evicted: nothing on disk yet
    assert daemons[0].stop() == 0
    assert len(list(disk.glob("*.kvpage"))) == 3
    again = tmp_path / "again"
    again.mkdir(mode=0o700)
    daemons.append(start(again, disk))
    assert looked_up(daemons[1]) == [1.0, 2.0, 3.0]


def tier_counts(daemon: DaemonProcess, medium: str = "disk") -> TierCounts:
    with internal_channel(daemon.address) as channel:
        stats = memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(memory_pb2.GetStatsRequest())
    assert stats.HasField(medium)
    return tier_counts_from_pb(getattr(stats, medium))


def media_of_prompt(daemon: DaemonProcess) -> dict[str, set[int]]:
    """Where the index's events (a new watcher's whole state) say each of the prompt's pages is, by medium."""
    keys = page_keys(PROMPT, SHAPE.page_size)
    with internal_channel(daemon.address) as channel:
        stub = memory_pb2_grpc.MemoryDaemonStub(channel)
        request = memory_pb2.WatchPrefixIndexRequest(model_id="test-model", after_sequence=0)
        state = next(iter(stub.WatchPrefixIndex(request, timeout=10)))
    media: dict[str, set[int]] = {}
    for change in state.changes:
        if change.WhichOneof("change") == "stored":
            name = memory_pb2.Medium.Name(change.medium).removeprefix("MEDIUM_").lower()
            media.setdefault(name, set()).add(keys.index(change.stored.key))
    return media


TWO_PAGES = str(2 * SHAPE.page_bytes)


def test_a_graceful_stop_short_of_disk_keeps_the_pages_used_last(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess], tmp_path: Path
) -> None:
    """Room on disk for three pages. Host memory holds two of the prompt, evicted from the pool, and the pool
    holds a newer prompt's three. A SIGTERM writes host memory's pages first, then the pool's, and the disk
    drops its oldest files for new ones: the next daemon finds the pool's pages, the ones used last."""
    flags = ("--kv-host-memory", TWO_PAGES, "--kv-disk-size", str(3 * (SHAPE.page_bytes + 200)))
    daemons.append(start(run_dir, disk, *flags))
    publish_prompt(daemons[0])
    evict_everything(daemons[0])  # two of its pages in host memory, the third on disk
    newer = [100 + token for token in PROMPT]
    publish_prompt(daemons[0], prompt=newer, first=4)
    assert daemons[0].stop() == 0
    assert len(list(disk.glob("*.kvpage"))) == 3
    again = tmp_path / "again"
    again.mkdir(mode=0o700)
    daemons.append(start(again, disk, *flags))
    assert looked_up(daemons[1]) == []
    assert looked_up(daemons[1], prompt=newer) == [4.0, 5.0, 6.0]


def test_evicted_pages_go_to_host_memory_then_on_to_disk_and_come_back_from_either(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess]
) -> None:
    """Host memory of two pages in front of the disk: of the prompt's three pages evicted, the first goes on
    to the disk when the third comes; a lookup brings them back from where each is, and the events say
    where that is."""
    daemons.append(start(run_dir, disk, "--kv-host-memory", TWO_PAGES))
    publish_prompt(daemons[0])
    evict_everything(daemons[0])
    host, on_disk = tier_counts(daemons[0], "host"), tier_counts(daemons[0])
    assert (host.pages, host.demotions, host.dropped, on_disk.demotions) == (2, 3, 1, 1)
    assert media_of_prompt(daemons[0]) == {"host": {1, 2}, "disk": {0}}

    assert looked_up(daemons[0]) == [1.0, 2.0, 3.0]
    host, on_disk = tier_counts(daemons[0], "host"), tier_counts(daemons[0])
    assert (host.promotions, host.bytes_read, on_disk.promotions) == (2, 2 * SHAPE.page_bytes, 1)
    assert media_of_prompt(daemons[0]) == {"pool": {0, 1, 2}, "host": {1, 2}, "disk": {0}}
    checked_counts(daemons[0])


def test_a_graceful_stop_hands_host_memory_down_to_the_disk(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess], tmp_path: Path
) -> None:
    """Two of the prompt's pages only in host memory, one on disk, none in the pool: a SIGTERM's stop writes
    the two, so that the next daemon serves all three from disk."""
    daemons.append(start(run_dir, disk, "--kv-host-memory", TWO_PAGES))
    publish_prompt(daemons[0])
    evict_everything(daemons[0])
    assert media_of_prompt(daemons[0]) == {"host": {1, 2}, "disk": {0}}
    wait_until(lambda: len(list(disk.glob("*.kvpage"))) == 1, 10, "the page host memory let go, on disk")
    assert daemons[0].stop() == 0
    assert len(list(disk.glob("*.kvpage"))) == 3
    again = tmp_path / "again"
    again.mkdir(mode=0o700)
    daemons.append(start(again, disk, "--kv-host-memory", TWO_PAGES))
    assert looked_up(daemons[1]) == [1.0, 2.0, 3.0]
    assert tier_counts(daemons[1]).promotions == 3


def next_changes(stream: Iterator[memory_pb2.PrefixIndexBatch], count: int) -> list[tuple[str, int, str]]:
    """The next count changes (a clear aside) a watcher's stream brings, as (what, page of the prompt,
    medium), sorted: how they are cut into batches is the daemon's to choose."""
    keys = page_keys(PROMPT, SHAPE.page_size)
    seen: list[tuple[str, int, str]] = []
    while len(seen) < count:
        for change in next(stream).changes:
            what = change.WhichOneof("change")
            if what != "cleared":
                key = change.stored.key if what == "stored" else change.removed
                medium = memory_pb2.Medium.Name(change.medium).removeprefix("MEDIUM_").lower()
                seen.append((what, keys.index(key), medium))
    return sorted(seen)


PAGE_DEMOTED = (("removed", "pool"), ("stored", "host"))  # a page the pool evicts into host memory


def test_a_watcher_is_told_each_move_between_the_media_as_it_happens(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess]
) -> None:
    """What a gateway that follows the index gets on the wire as pages move, each change naming its medium
    (a new watcher's state, as above, holds only where pages are now, never a removal): an eviction takes
    the prompt's pages out of the pool into host memory, which lets the first go on to the disk; a lookup
    stores them in the pool again; DropPublished removes them from every medium that has them."""
    daemons.append(start(run_dir, disk, "--kv-host-memory", TWO_PAGES))
    publish_prompt(daemons[0])
    with internal_channel(daemons[0].address) as channel:
        request = memory_pb2.WatchPrefixIndexRequest(model_id="test-model", after_sequence=0)
        # A change that never comes ends the stream at its deadline.
        stream = memory_pb2_grpc.MemoryDaemonStub(channel).WatchPrefixIndex(request, timeout=30)
        assert next_changes(stream, 3) == [("stored", i, "pool") for i in range(3)]  # the state

        evict_everything(daemons[0])
        into_host_memory = [(what, i, medium) for i in range(3) for what, medium in PAGE_DEMOTED]
        on_to_the_disk = [("removed", 0, "host"), ("stored", 0, "disk")]
        assert next_changes(stream, 8) == sorted(into_host_memory + on_to_the_disk)

        assert looked_up(daemons[0]) == [1.0, 2.0, 3.0]
        assert next_changes(stream, 3) == [("stored", i, "pool") for i in range(3)]  # the tiers keep theirs

        dropped = memory_pb2_grpc.MemoryDaemonStub(channel).DropPublished(
            memory_pb2.DropPublishedRequest(worker_name="writer")
        )
        assert dropped.pages == 3
        expected = [("removed", 0, "disk"), *(("removed", i, "host") for i in (1, 2))]
        assert next_changes(stream, 6) == sorted([("removed", i, "pool") for i in range(3)] + expected)
    assert media_of_prompt(daemons[0]) == {}


def test_a_prefetch_brings_the_chain_back_before_the_lookup(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess]
) -> None:
    """PrefetchPrefix (what a worker sends as a request arrives) reads the chain's files off the daemon's
    loop and installs them as idle cached pages; the lookup then finds them in the pool, reading nothing."""
    daemons.append(prompt_on_disk(run_dir, disk))
    before = tier_counts(daemons[0])
    assert (before.pages, before.demotions, before.promotions, before.rejected) == (3, 3, 0, 0)
    assert before.bytes == sum(path.stat().st_size for path in disk.glob("*.kvpage"))
    agent = KVAgent(daemons[0].address, "warm", num_pages=POOL_PAGES)
    try:
        assert agent("promote", tokens=[*PROMPT, 99]) == [3, 3]  # 3 promoted, 3 leading pages cached
        assert agent("promote", tokens=PROMPT) == [0, 3]  # nothing left to bring back
        counts = checked_counts(daemons[0])
        assert (counts.cached_pages, counts.evictable_pages) == (3, 3)  # cached, no one holds them yet
        assert tier_counts(daemons[0]).promotions == 3
    finally:
        agent.close()
    assert looked_up(daemons[0]) == [1.0, 2.0, 3.0]
    after = tier_counts(daemons[0])
    assert after.promotions == 3 and after.bytes_read == before.bytes and after.promote_seconds > 0


def test_a_page_damaged_on_disk_is_refused_and_the_prefix_stops_before_it(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess], tmp_path: Path
) -> None:
    daemons.append(prompt_on_disk(run_dir, disk))
    second_key = page_keys(PROMPT, SHAPE.page_size)[1]
    damaged = disk / file_name(fingerprint("test-model", SHAPE), second_key)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x01  # one bit of the payload
    damaged.write_bytes(bytes(data))

    daemons.append(restart(daemons[0], disk, tmp_path))
    assert KVAgent(daemons[1].address, "first", num_pages=POOL_PAGES).close() == 0  # the model's pool made
    assert media_of_prompt(daemons[1]) == {"disk": {0, 1, 2}}  # from the files' headers: none read yet
    assert looked_up(daemons[1]) == [1.0], "the first page only: the second failed its CRC"
    assert not damaged.exists()
    assert len(list(disk.glob("*.kvpage"))) == 2
    assert media_of_prompt(daemons[1]) == {"pool": {0}, "disk": {0, 2}}  # the refused page announced gone


def test_a_workers_pages_are_dropped_from_the_tiers_too(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess]
) -> None:
    """DropPublished takes out every page a worker published, also those the pool demoted to host memory
    and to disk: before, they came back on the next lookup, named as the tier's."""
    daemon = start(run_dir, disk, "--kv-host-memory", TWO_PAGES)  # two in host memory, one on disk
    daemons.append(daemon)
    publish_prompt(daemon)
    evict_everything(daemon)
    wait_until(lambda: len(list(disk.glob("*.kvpage"))) == 1, 10, "the first page's file")
    assert tier_counts(daemon, "host").pages == 2
    with internal_channel(daemon.address) as channel:
        stub = memory_pb2_grpc.MemoryDaemonStub(channel)
        dropped = stub.DropPublished(memory_pb2.DropPublishedRequest(worker_name="writer"))
    assert dropped.pages == 3
    assert looked_up(daemon) == []
    wait_until(lambda: not list(disk.glob("*.kvpage")), 10, "the file deleted")
    assert tier_counts(daemon, "host").pages == 0
    counts = checked_counts(daemon)
    assert counts.cached_pages == 0 and not counts.publishers


def test_a_folder_under_a_page_files_name_is_refused_at_start_and_while_running(
    run_dir: Path, disk: Path, daemons: list[DaemonProcess], tmp_path: Path
) -> None:
    """A folder where a page's file should be (made by the daemon's own user: no one else can write the
    tier's folder) is no page: at start the chain stops before it, and a daemon that finds one on a lookup
    refuses it the same way, losing no page of its pool to the failed read. An empty folder is removed; one
    with something in it is not ours to empty, and stays."""
    daemons.append(prompt_on_disk(run_dir, disk))
    keys = page_keys(PROMPT, SHAPE.page_size)
    files = [disk / file_name(fingerprint("test-model", SHAPE), key) for key in keys]
    files[1].unlink()
    files[1].mkdir(mode=0o700)
    (files[1] / "kept").write_bytes(b"not a page")

    daemons.append(restart(daemons[0], disk, tmp_path))
    assert looked_up(daemons[1]) == [1.0], "the first page only: the second is a folder"
    assert (files[1] / "kept").exists()

    evict_everything(daemons[1])
    wait_until(lambda: files[0].exists(), 10, "the first page's file written again")
    files[0].unlink()
    files[0].mkdir(mode=0o700)
    free = checked_counts(daemons[1]).free_pages
    for _ in range(3):
        assert looked_up(daemons[1]) == []
    assert checked_counts(daemons[1]).free_pages == free  # the books balance, and no page went missing
    assert not files[0].exists()
    assert daemons[1].proc.poll() is None


@pytest.fixture
def volume() -> Iterator[Path]:
    """A folder as a Kubernetes emptyDir's root is: root's, 0777 without the sticky bit, so that another user
    (tests/second_user.py) may rename, make and remove what is in it."""
    path = Path(tempfile.mkdtemp(prefix="ps-volume-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_tier_in_a_volume_others_can_write_reads_only_its_own_folder(
    run_dir: Path, volume: Path, daemons: list[DaemonProcess], tmp_path: Path
) -> None:
    """The tier's folder may lie in such a volume (the manifests' daemon keeps it in an emptyDir): the daemon
    opens it once and reaches its files only through that descriptor. Another user who swaps the folder's
    name for a folder of their own, with a page file planted under a real page's name, changes nothing for
    the running daemon; a daemon started later refuses their folder, and a symlink in its place."""
    disk = volume / "kv"
    daemons.append(prompt_on_disk(run_dir, disk))
    ours = volume / "ours"
    run_as_second_user("mv", str(disk), str(ours))
    run_as_second_user("mkdir", "-m", "0700", str(disk))
    planted = disk / file_name(fingerprint("test-model", SHAPE), page_keys(PROMPT, SHAPE.page_size)[0])
    run_as_second_user("truncate", "--size=4096", str(planted))  # no page: any file of theirs
    assert looked_up(daemons[0]) == [1.0, 2.0, 3.0], "the pages in its own folder, from wherever it lies"
    assert tier_counts(daemons[0]).rejected == 0 and len(list(ours.glob("*.kvpage"))) == 3

    daemons[0].kill()
    again = tmp_path / "again"
    again.mkdir(mode=0o700)
    assert "belongs to uid 65534" in refused(again, "--kv-disk", str(disk), "--kv-disk-size", "1MiB")
    run_as_second_user("rm", "-r", str(disk))
    run_as_second_user("ln", "-s", str(ours), str(disk))
    assert "cannot be opened as a folder" in refused(again, "--kv-disk", str(disk), "--kv-disk-size", "1MiB")


def refused(run_dir: Path, *extra: str) -> str:
    """The daemon run with extra flags: it must exit non-zero; returns what it said."""
    command = [sys.executable, "-m", "memory_daemon", "--address", f"unix:{run_dir}/daemon.sock", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_a_disk_tier_without_a_budget_or_in_an_open_folder_is_refused(run_dir: Path, disk: Path) -> None:
    for extra, message in (
        (("--kv-disk", str(disk)), "--kv-disk DIR and --kv-disk-size SIZE"),
        (("--kv-disk-size", "1GiB"), "--kv-disk DIR and --kv-disk-size SIZE"),
        (("--kv-host-memory", "lots"), "is not a size"),
    ):
        assert message in refused(run_dir, *extra)
    assert not disk.exists()
    disk.mkdir(mode=0o755)
    disk.chmod(0o755)  # other users could read the pages, or plant their own
    assert "open to others" in refused(run_dir, "--kv-disk", str(disk), "--kv-disk-size", "1GiB")


@pytest.mark.parametrize("medium", ["disk", "host"])
def test_a_prompt_served_from_a_tier_gives_the_same_greedy_tokens(
    run_dir: Path, disk: Path, medium: str
) -> None:
    """The whole stack on the default model with a pool of a few dozen pages: a prompt's pages, pushed out
    of the pool by other prompts, come back from disk (or from host memory), and the same prompt gives the
    same greedy tokens from them (its prompt tokens counted as cached), with the books balanced."""
    tier_flags = {
        "disk": ("--kv-disk", str(disk), "--kv-disk-size", "256MiB"),
        "host": ("--kv-host-memory", "256MiB"),
    }
    stack = start_stack(run_dir, "--kv-memory", "24MiB", *tier_flags[medium])
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            def complete(prompt: str) -> pb.GenerateResponse:
                return stub.Complete(generate_request(prompt=prompt, max_tokens=12, temperature=0.0))

            prompt = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(24))
            first = complete(prompt)
            for other in range(6):  # each about as long, none sharing a page with it
                complete(f"Story {other}: " + " ".join(f"{other} then {i}." for i in range(60)))
            daemon = stack.endpoints()["daemon"]

            def tier(counter: str) -> float:
                return Scrape(daemon["metrics"])(f"pagedserve_kv_tier_{counter}_total", tier=medium)

            wait_until(lambda: tier("demotions") > 0, 5, "the pool's evictions to reach the tier")
            assert tier("promotions") == 0
            again = complete(prompt)
            assert list(again.token_ids) == list(first.token_ids) and again.text == first.text
            cached_pages = again.usage.cached_prompt_tokens // 16
            assert (
                cached_pages == (first.usage.prompt_tokens - 1) // 16
            )  # every full page but the last token's
            # All of them from the tier (the metrics' snapshot is at most half a second old).
            wait_until(
                lambda: tier("promotions") == cached_pages,
                5,
                lambda: f"{cached_pages} promotions, not {tier('promotions')}",
            )
            # Each page read once: a lookup that comes while the request's prefetch reads them waits.
            page_bytes = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2's page in float32
            header = {"disk": 1024, "host": 0}[medium]  # a file's header's room
            assert tier("read_bytes") <= cached_pages * (page_bytes + header)
            wait_for_every_page(daemon["address"])
    finally:
        assert stack.stop() == 0, stack.log()
