"""Pins and their budgets on the whole stack (`pagedserve up`, the default model, a pool of 33 pages): a
request's cache_ttl_seconds keeps its prompt cached against other tenants' traffic and past its worker's
SIGKILL, a pinned conversation goes on, a tenant over its pin budget is refused with RESOURCE_EXHAUSTED
naming the budget while another tenant's traffic runs, and a pin ends on time. The tenants are cache_salt
namespaces (the frontend has no tokens); the daemon's books balance (`check_invariants`) throughout."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from memory_daemon.stats import PoolCounts
from memory_daemon.wire import counts_from_pb
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.plumbing.pin_limits import MAX_TTL_S
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from services.frontend.identity import ClientIdentity
from tests.clients import internal_channel
from tests.procs import Stack, start_stack
from tests.waiting import wait_until

PAGE = 16
TENANT_PAGES = 8  # --tenant-pin-share 0.25 of 33 pages
ALICE = ClientIdentity([]).tenant(None, "alice")
BOB = ClientIdentity([]).tenant(None, "bob")


def prompt(topic: str, sentences: int) -> str:
    return f"Notes on {topic}: " + " ".join(
        f"{topic} fact {i} is that {i} plus {i} is {2 * i}." for i in range(sentences)
    )


def checked_counts(stack: Stack) -> PoolCounts:
    with internal_channel(stack.daemon_address) as channel:
        stats = memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(
            memory_pb2.GetStatsRequest(check_invariants=True)
        )
    (pool,) = stats.pools
    return counts_from_pb(pool)


def pinned_by(stack: Stack) -> dict[str, int]:
    return {t.tenant: t.pinned_pages for t in checked_counts(stack).tenants}


def pins_landed(stack: Stack, tenant: str) -> dict[str, int]:
    """The pins once tenant's has reached the daemon: a worker sends a pin after its response, in order
    before it lets the pages go, so the pages stay held until then but the daemon's counts may lag."""
    return wait_until(
        lambda: tenant in (pins := pinned_by(stack)) and pins, 10, f"{tenant}'s pin to reach the daemon"
    )


@pytest.fixture
def stack(run_dir: Path) -> Iterator[Stack]:
    running = start_stack(run_dir, "--kv-memory", "24MiB", "--pin-share", "0.5", "--tenant-pin-share", "0.25")
    yield running
    assert running.stop() == 0, running.log()


class Tenants:
    """The stack's public port, as the tenants (cache_salt namespaces) of this test use it."""

    def __init__(self, stack: Stack, channel: grpc.Channel) -> None:
        self.stack = stack
        self._stub = generation_pb2_grpc.GenerationStub(channel)
        self._floods = itertools.count()

    def complete(self, text: str, salt: str = "", ttl: int = 0, max_tokens: int = 8) -> pb.GenerateResponse:
        request = generate_request(
            prompt=text, cache_salt=salt, cache_ttl_seconds=ttl, max_tokens=max_tokens, temperature=0.0
        )
        return self._stub.Complete(request, timeout=120)

    def refusal(self, text: str, salt: str = "", ttl: int = 0) -> str:
        """The RESOURCE_EXHAUSTED message the request gets."""
        with pytest.raises(grpc.RpcError) as refused:
            self.complete(text, salt, ttl)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        return str(refused.value.details())

    def flood(self, rounds: int = 6) -> None:
        """Unpinned prompts, none sharing a page with another: together more than the pool holds."""
        for _ in range(rounds):
            self.complete(prompt(f"flood{next(self._floods)}", 12), max_tokens=1)

    def answers(self) -> bool:
        try:
            self.complete("hello", max_tokens=1)
        except grpc.RpcError:
            return False
        return True


def test_pins_hold_against_other_tenants_outlive_a_worker_and_end_on_time(stack: Stack) -> None:
    with grpc.insecure_channel(stack.address) as channel:
        tenants = Tenants(stack, channel)
        assert checked_counts(stack).total_pages == 33
        # A request the pool could hold only by evicting pins is refused, not left waiting for them to end.
        assert "less the 16 that pins may hold" in tenants.refusal(prompt("big", 20))

        alice = prompt("alice", 5)  # about 90 tokens
        # The longest pin there is: it reaches the daemon as asked (a longer one would be refused there).
        first = tenants.complete(alice, "alice", ttl=MAX_TTL_S)
        # Its prompt's and its output's full pages: all but the last token's KV is in the pool.
        pinned = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // PAGE
        assert pins_landed(stack, ALICE) == {ALICE: pinned} and pinned <= 6
        pinned = her_conversation_goes_on(tenants, alice, first, pinned)

        bob_under_his_budget(tenants)
        assert pinned_by(stack)[ALICE] == pinned
        message = tenants.refusal(prompt("alice-more", 5), "alice", ttl=600)  # over her own budget
        assert f"tenant {ALICE!r} has pinned {pinned} of the {TENANT_PAGES} pages" in message

        # Every unpinned page was evicted by the floods; alice's came through, for the same greedy tokens.
        assert checked_counts(stack).evictions > 0
        full_pages = first.usage.prompt_tokens // PAGE
        again = tenants.complete(alice, "alice")
        assert again.usage.cached_prompt_tokens == full_pages * PAGE
        assert list(again.token_ids) == list(first.token_ids)

        # The pin is the daemon's: it outlives the worker's SIGKILL, and holds against a new flood.
        killed = stack.pid("worker")
        os.kill(killed, signal.SIGKILL)
        wait_until(lambda: _worker_pid(stack) not in (None, killed), 60, "a new worker")
        wait_until(tenants.answers, 120, "the new worker to answer", interval_s=0.5)
        tenants.flood()
        assert tenants.complete(alice, "alice").usage.cached_prompt_tokens == full_pages * PAGE

        # The pool's budget holds too: with alice's and bob's pins, a third tenant has room for few pages.
        message = tenants.refusal(prompt("dave-long", 6), "dave", ttl=3)
        assert "all tenants together have pinned" in message and "(--pin-share 0.5 of its pages)" in message
        a_short_pin_ends_on_time(tenants)
        assert ALICE in pinned_by(stack)


def her_conversation_goes_on(tenants: Tenants, alice: str, first: pb.GenerateResponse, pinned: int) -> int:
    """Alice's pinned prompt again, and then with more on it, pinned again: the pages she pins already cost
    her nothing (they once counted anew, and 6 pinned pages and the same 6 again were over her 8). Returns
    the pages she pins now."""
    again = tenants.complete(alice, "alice", ttl=600)
    assert list(again.token_ids) == list(first.token_ids)
    assert pinned_by(tenants.stack)[ALICE] == pinned
    more = tenants.complete(alice + " Say it all again, briefly.", "alice", ttl=600)
    # Its pages past the prompt's full pages that the first request pinned are new (the first request's
    # output page differs from this prompt's).
    pages = (more.usage.prompt_tokens + more.usage.completion_tokens - 1) // PAGE
    now = pinned + pages - first.usage.prompt_tokens // PAGE
    assert pinned < now <= TENANT_PAGES
    wait_until(lambda: pinned_by(tenants.stack)[ALICE] == now, 10, f"alice to pin {now} pages")
    return now


def bob_under_his_budget(tenants: Tenants) -> None:
    """Bob's traffic, four at a time beside an unpinned flood, pins what his budget allows; the rest of it is
    refused up front with a message naming the budget, or (two requests checked at once) left unpinned."""

    def bob(i: int) -> grpc.StatusCode:
        try:
            tenants.complete(prompt(f"bob{i}", 5), "bob", ttl=600)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            assert "--tenant-pin-share 0.25" in exc.details() and f"tenant {BOB!r}" in exc.details()
            return exc.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(4) as pool:
        codes = pool.map(bob, range(8))
        tenants.flood()
        codes = list(codes)
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
    assert 0 < pins_landed(tenants.stack, BOB)[BOB] <= TENANT_PAGES


def a_short_pin_ends_on_time(tenants: Tenants) -> None:
    """A pin of 3 seconds ends 3 seconds after its request, and its pages go with the next flood."""
    dave = prompt("dave", 2)  # two full pages
    assert tenants.complete(dave, "dave", ttl=3).usage.prompt_tokens > 2 * PAGE
    done = time.monotonic()
    tenant = ClientIdentity([]).tenant(None, "dave")
    pins_landed(tenants.stack, tenant)
    wait_until(lambda: tenant not in pinned_by(tenants.stack), 10, "dave's pin to end", interval_s=0.1)
    assert time.monotonic() - done > 2.5
    tenants.flood()
    assert tenants.complete(dave, "dave").usage.cached_prompt_tokens == 0


def _worker_pid(stack: Stack) -> int | None:
    try:
        return stack.pid("worker")
    except ValueError:  # none, while up starts it again
        return None
