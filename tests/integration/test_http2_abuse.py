"""HTTP/2 abuse of the public port, sent frame by frame (tests/h2_attacker.py) at a real `pagedserve up`:
rapid reset (CVE-2023-44487), a CONTINUATION flood (the CVE-2024-27316 class) and a header block that decodes
past the limit. The frontend must go on serving, with its memory bounded, and each attack must be seen to
land.

Memory is the frontend's VmRSS. A header block is refused at the metadata limit (16 KiB) and a connection
holds at most max_concurrent_streams calls, so a bounded frontend needs next to nothing for either attack:
a flood may cost it 64 MiB of allocator slack at most. Opening and resetting some 10^6 streams leaves more
slack behind in the allocator (up to 55 MiB seen on two cores); 96 MiB bounds that, and a leak of 100 bytes
a stream would pass it. Run with -s for the figures each test prints.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import hpack
import pytest

from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.clients import Scrape, wait_for_every_page
from tests.h2_attacker import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    RST_STREAM,
    RawConnection,
    continuation_flood,
    frame,
    grpc_message,
    header_block,
    peak_rss,
    rapid_reset,
    rss_mib,
)
from tests.integration.streams import frontend_cpu_seconds, wait_for_idle_worker
from tests.procs import Stack, module_stack
from tests.waiting import wait_until

GENERATE, COMPLETE = "/pagedserve.v1.Generation/Generate", "/pagedserve.v1.Generation/Complete"
FLOOD_RSS_MIB, RESET_RSS_MIB = 64, 96
ATTACK = generate_request(token_ids=[1, 504, 3458, 28, 253], max_tokens=64, ignore_eos=True)
FLOOD_CONNECTIONS, FLOOD_BYTES = 4, 128 * 2**20  # each: 8000 times the metadata limit
PAD = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple("x-pad", "a" * 100)], huffman=False)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack() as running:
        yield running


def in_flight_bytes() -> int:
    """The most a flood may have written that the server never read: what the server's receive buffer and the
    attacker's send buffer may grow to (the kernel's tcp_rmem and tcp_wmem maxima), and one more write."""
    net = Path("/proc/sys/net/ipv4")
    return sum(int((net / name).read_text().split()[2]) for name in ("tcp_rmem", "tcp_wmem")) + 2**20


def host_port(stack: Stack) -> tuple[str, int]:
    host, port = stack.address.rsplit(":", 1)
    return host, int(port)


def calls_handled(stack: Stack) -> float:
    """Generate and Complete calls that reached the frontend's servicer, whatever their end."""
    samples = Scrape(stack.metrics_url("frontend")).samples
    return sum(value for (name, _), value in samples.items() if name == "pagedserve_requests_total")


def greedy_tokens(stack: Stack) -> tuple[list[int], float]:
    """A normal client's Generate on a fresh channel: its tokens, and how long it took."""
    request = generate_request("The capital of France is", max_tokens=8, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    with grpc.insecure_channel(stack.address) as channel:
        replies = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)
        tokens = [token for reply in replies for token in reply.token_ids]
    return tokens, time.monotonic() - start


def in_threads(task: Callable[[RawConnection], int], connections: list[RawConnection]) -> list[int]:
    results = [0] * len(connections)

    def run(index: int) -> None:
        results[index] = task(connections[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(connections))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def rapid_resets(stack: Stack, connections: int, seconds: float, lag: bool) -> tuple[int, int, list[str]]:
    """Rapid reset on connections at once: (streams written, highest stream id answered, reactions)."""
    block, message = header_block(stack.address, GENERATE), grpc_message(ATTACK.SerializeToString())
    conns = [RawConnection(*host_port(stack)) for _ in range(connections)]
    sent = in_threads(lambda conn: rapid_reset(conn, block, message, seconds, lag=lag), conns)
    opened = frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, END_STREAM, 1, message)
    per_stream = len(opened) + len(frame(RST_STREAM, 0, 1, b"\0\0\0\x08"))
    for conn, streams in zip(conns, sent, strict=True):
        assert conn.bytes_written >= streams * per_stream, "the attacker did not write what it counted"
        conn.close()
    answered = max(conn.reaction.highest_answered for conn in conns)
    reactions = [f"{n} streams: {c.reaction.summary()}" for n, c in zip(sent, conns, strict=True)]
    return sum(sent), answered, reactions


def test_rapid_reset_leaves_the_frontend_serving_with_bounded_memory(stack: Stack) -> None:
    reference, _ = greedy_tokens(stack)
    pid = stack.pid("frontend")
    rss, cpu, handled = rss_mib(pid), frontend_cpu_seconds(stack), calls_handled(stack)
    start = time.monotonic()
    with peak_rss(pid) as peak:
        # Reset in the write that opens them, on one connection; then one write later, on three.
        one, answered_one, reactions = rapid_resets(stack, connections=1, seconds=4, lag=False)
        middle = time.monotonic()
        several, answered_several, more = rapid_resets(stack, connections=3, seconds=4, lag=True)
    times = f"{middle - start:.1f}s and {time.monotonic() - middle:.1f}s"
    started = calls_handled(stack) - handled
    print(
        f"\nrapid reset: {one} streams on 1 connection, {several} on 3, in {times}; {started:.0f} reached "
        f"the servicer; frontend CPU {frontend_cpu_seconds(stack) - cpu:.1f}s; RSS {rss:.0f} MiB -> peak "
        f"{peak[0]:.0f}",
        *reactions,
        *more,
        sep="\n  ",
    )
    assert one >= 50_000 and several >= 50_000, "the attack hardly ran"
    # The server saw the streams: it answered some (refused, reset, trailers), or its servicer ran them.
    assert started > 0 or max(answered_one, answered_several) > 0
    os.kill(pid, 0)  # alive, and still the stack's frontend
    assert stack.pid("frontend") == pid
    wait_for_idle_worker(stack, timeout_s=60)
    wait_for_every_page(stack.daemon_address)
    tokens, answer_s = greedy_tokens(stack)
    settled = rss_mib(pid)
    print(f"  then: a normal Generate in {answer_s:.2f}s, RSS {settled:.0f} MiB")
    assert tokens == reference and answer_s < 30
    assert settled - rss < RESET_RSS_MIB, f"RSS {rss:.0f} -> {settled:.0f} MiB"


class NormalClient:
    """Completes, one after another on one channel, in a thread, while something else goes on."""

    def __init__(self, stack: Stack) -> None:
        self.done: list[float] = []  # each call's seconds
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stack.address,), daemon=True)
        self._thread.start()

    def _run(self, address: str) -> None:
        request = generate_request("Hi", max_tokens=2, ignore_eos=True)
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    stub.Complete(request, timeout=30)
                    self.done.append(time.monotonic() - start)
                except grpc.RpcError as error:
                    self.errors.append(f"{error.code().name}: {error.details()}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def test_a_continuation_flood_is_cut_off_and_memory_stays_bounded(stack: Stack) -> None:
    pid = stack.pid("frontend")
    rss, cpu = rss_mib(pid), frontend_cpu_seconds(stack)
    block, fragment = header_block(stack.address, GENERATE), PAD * (16000 // len(PAD))
    conns = [RawConnection(*host_port(stack), write_timeout_s=5) for _ in range(FLOOD_CONNECTIONS)]
    normal = NormalClient(stack)
    start = time.monotonic()
    with peak_rss(pid) as peak:
        frames = in_threads(lambda conn: continuation_flood(conn, block, fragment, FLOOD_BYTES), conns)
        flood_s = time.monotonic() - start
        # The attackers' header blocks are still open: the normal client must be served meanwhile.
        served = len(normal.done)
        wait_until(lambda: len(normal.done) >= served + 3, 60, lambda: f"3 more calls; {normal.errors}")
        held = rss_mib(pid)
    normal.stop()
    for conn in conns:
        conn.close()
    taken = [conn.bytes_written >> 20 for conn in conns]
    print(
        f"\nCONTINUATION flood: {FLOOD_CONNECTIONS} connections, {frames} CONTINUATION frames, "
        f"{taken} MiB taken in {flood_s:.1f}s (stalled: {[c.stalled for c in conns]}); frontend CPU "
        f"{frontend_cpu_seconds(stack) - cpu:.1f}s; RSS {rss:.0f} MiB -> peak {peak[0]:.0f}, "
        f"{held:.0f} with the blocks open, {rss_mib(pid):.0f} after; normal calls {len(normal.done)}, "
        f"slowest {max(normal.done):.2f}s, errors {normal.errors[:3]}",
        *(conn.reaction.summary() for conn in conns),
        sep="\n  ",
    )
    # Each attacker took its block past the frontend's limit (32 KiB): the guard closes a connection on the
    # frame header that breaks it, so two whole CONTINUATION frames at least were sent on each.
    assert min(frames) >= 2, f"CONTINUATION frames sent per connection: {frames}"
    # The server parsed the block far enough to refuse the stream, or closed the connection.
    assert all(conn.reaction.statuses or conn.reaction.resets or conn.reaction.closed for conn in conns)
    assert not normal.errors and max(normal.done) < 10
    os.kill(pid, 0)
    assert greedy_tokens(stack)[1] < 30
    limit = in_flight_bytes()
    assert limit < FLOOD_BYTES // 2
    assert max(taken) < limit >> 20, f"the frontend read {taken} MiB of endless header blocks"
    assert peak[0] - rss < FLOOD_RSS_MIB, f"RSS {rss:.0f} -> peak {peak[0]:.0f} MiB"


def test_a_header_list_that_decodes_past_the_limit_is_refused_cleanly(stack: Stack) -> None:
    pid = stack.pid("frontend")
    conn = RawConnection(*host_port(stack))
    assert conn.handshake()
    # One 4 KiB header, indexed into the decoder's table, then named by its index 256 times: a HEADERS
    # frame of 4.3 KiB whose header list is 1 MiB.
    encoder = hpack.Encoder()
    bomb = header_block(stack.address, COMPLETE) + encoder.encode([("x-bomb", "b" * 4000)]) + b"\xbe" * 256
    assert len(bomb) < 16384
    conn.write(frame(HEADERS, END_HEADERS | END_STREAM, 1, bomb))
    body = grpc_message(generate_request("Hi", max_tokens=2, ignore_eos=True).SerializeToString())
    conn.write(frame(HEADERS, END_HEADERS, 3, header_block(stack.address, COMPLETE)))
    conn.write(frame(DATA, END_STREAM, 3, body))
    reaction = conn.reaction
    wait_until(
        lambda: reaction.closed or (reaction.answered(1) and reaction.answered(3)),
        30,
        lambda: f"an answer on both streams; {reaction.summary()}",
    )
    closed = reaction.closed
    conn.close()
    print(f"\nheader list bomb: {reaction.summary()}; stream 1: {reaction.statuses.get(1)}")
    assert not closed and reaction.goaway is None  # the stream is refused, not the connection
    assert reaction.statuses.get(1, "").startswith("8 ") or 1 in reaction.resets  # RESOURCE_EXHAUSTED
    assert reaction.statuses[3].startswith("0 "), reaction.statuses[3]  # the next call on it is served
    os.kill(pid, 0)
    assert "Traceback" not in stack.log()
