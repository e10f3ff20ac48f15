"""A worker lost mid-stream, and clients that never notice: two workers on one daemon, one SIGKILLed or frozen
with SIGSTOP while it holds a stream of every kind (greedy, seeded, stop strings, penalties, a regex, n = 2,
logprobs). Each moved stream, and each stream of the other worker, must end OK with exactly the tokens (and
text, and finish) of an uninterrupted run; the moved requests must find their pages in the daemon's prefix
cache, and every page must come back. A request that kills each worker it lands on is given up after
--max-failovers.

The lost worker's calls are started while the other one is SIGSTOPped and routed around, so that only it
can serve them; the other calls then go to the other worker, which has fewer in flight. 16 sequences in all,
so that the worker left holds at most 16 after the loss: up to 16 rows, a CPU decode step's GEMMs give every
row the same bits whatever the batch's size (pagedserve/kernels/cpu/skinny_linear.cpp), and over 16 they take
MKL, which rounds differently.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator

import grpc
import pytest

from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.client import generate_request
from tests.clients import Scrape, every_page_accounted, internal_channel, pool_counts
from tests.integration.failover_calls import (
    Call,
    assert_same,
    finish,
    pid_of_worker,
    routed_around,
    start,
    streaming,
)
from tests.integration.streams import worker_load
from tests.procs import Stack, module_stack
from tests.waiting import wait_until

KILL_AFTER = 24  # tokens each stream of the lost worker has had when it is lost
STOP_AFTER = 64  # tokens before a stop string strikes: after the loss
PAGE = 16
FLAGS = ("--workers", "2", "--kv-memory", "512MiB", "--max-failovers", "1", "--worker-timeout", "3")
SEEDED = {"temperature": 0.9, "top_p": 0.95}
# The lost worker's calls, one of each; the other worker's are the same but for the n = 2 one.
RECIPES = {
    "greedy": {"logprobs": 2},
    "seeded": SEEDED,
    "greedy stop": {"repetition_penalty": 1.2},  # greedy alone repeats itself: no string is new late
    "seeded stop": SEEDED,
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "n = 2": SEEDED | {"n": 2},
    "regex": {"structured": pb.StructuredOutput(regex="[a-z]+( [a-z]+)*")},
    "seeded logprobs": SEEDED | {"logprobs": 2},
}
NAMES = [*RECIPES, *(name for name in RECIPES if name != "n = 2")]
LOST = len(RECIPES)  # the first LOST calls go to the worker that is lost


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack(*FLAGS) as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def requests(stops: dict[int, str] | None = None) -> list[pb.GenerateRequest]:
    """Distinct random token prompts, so that only a failover (and an n = 2 call's second sample) finds
    pages in the prefix cache."""
    rng = random.Random(17)
    made = []
    for i, name in enumerate(NAMES):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randrange(40, 70))]
        sampling = {"max_tokens": 96, "ignore_eos": True, "temperature": 0.0} | RECIPES[name]
        if "seed" not in sampling and sampling["temperature"]:
            sampling["seed"] = 1000 + i
        if stops and i in stops:
            sampling["stop"] = [stops[i]]
        made.append(generate_request(token_ids=prompt, **sampling))
    return made


def late_stops(calls: list[Call]) -> dict[int, str]:
    """For each stop call, a stop string that first appears in its text after its STOP_AFTER-th token."""
    stops = {}
    for i, name in enumerate(NAMES):
        if "stop" not in name:
            continue
        responses, tokens = calls[i].sample(), 0
        before = next(
            k for k, r in enumerate(responses) if (tokens := tokens + len(r.token_ids)) >= STOP_AFTER
        )
        text, offset = calls[i].text(), len("".join(r.text for r in responses[: before + 1]))
        for start_at in range(offset, len(text) - 4):
            candidate = text[start_at : start_at + 4]
            if candidate.strip() and text.find(candidate) == start_at:
                stops[i] = candidate
                break
    return stops


@pytest.fixture(scope="module")
def reference(stack: Stack, stub: generation_pb2_grpc.GenerationStub) -> list[Call]:
    """The calls, uninterrupted, with stop strings that strike after any failover: the stop calls run again
    with theirs, and the rest, whose requests those strings do not change, are kept from the first run."""
    calls = finish(start(stub, requests()))
    stops = late_stops(calls)
    assert len(stops) == sum("stop" in name for name in NAMES), stops
    with_stops = requests(stops)
    for i, call in zip(stops, finish(start(stub, [with_stops[i] for i in stops])), strict=True):
        calls[i] = call
    assert [call.request for call in calls] == with_stops
    assert all(call.code == grpc.StatusCode.OK for call in calls), [call.details for call in calls]
    assert all(calls[i].sample()[-1].matched_stop_str == stop for i, stop in stops.items())
    return calls


def kinds(request: pb.GenerateRequest) -> set[str]:
    sampling = request.sampling
    found = {"seeded" if sampling.HasField("seed") else "greedy"}
    found |= {"stop string"} if sampling.stop else set()
    found |= {"structured"} if sampling.HasField("structured") else set()
    found |= {"n > 1"} if sampling.n > 1 else set()
    return found


def links_up(stack: Stack) -> bool:
    """Whether the frontend has a link up to every worker since its latest start."""
    log = stack.log()
    return all(log.count(f"(worker-{i}) is up") > log.count(f"worker-{i} is back") for i in range(2))


def books_balance(stack: Stack) -> bool:
    """Both workers idle, every page accounted for, and the daemon's own audit of its books passes."""
    with internal_channel(stack.daemon_address) as channel:
        memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(memory_pb2.GetStatsRequest(check_invariants=True))
    loads = [worker_load(stack, i) for i in range(2)]
    return not any(load.running or load.kv_pages_in_use for load in loads) and every_page_accounted(
        stack.daemon_address
    )


def failovers(stack: Stack, outcome: str) -> float:
    return Scrape(stack.metrics_url("frontend"))("pagedserve_failovers_total", outcome=outcome)


def flush_prefix_cache(stack: Stack) -> None:
    """Drop the idle cached pages of the namespace the stack's workers cache under (all run alike)."""
    with internal_channel(stack.worker_address(0)) as channel:
        namespace = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest()).kv_namespace
    with internal_channel(stack.daemon_address) as channel:
        memory_pb2_grpc.MemoryDaemonStub(channel).FlushPrefixIndex(
            memory_pb2.FlushPrefixIndexRequest(model_id=namespace)
        )


def place(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, reference: list[Call]
) -> tuple[list[Call], list[Call]]:
    """The reference's calls again: the first LOST on worker-0, the rest on worker-1, each streaming."""
    with routed_around(stack, 1):
        lost = start(stub, [call.request for call in reference[:LOST]])
        # A token while worker-1 is stopped can only come from worker-0.
        wait_until(lambda: streaming(lost, 1), 120, "worker-0's calls to stream", 0.01)
    kept = start(stub, [call.request for call in reference[LOST:]])
    wait_until(lambda: streaming(lost, KILL_AFTER) and streaming(kept, 1), 120, "every call to stream", 0.01)
    sequences = [sum(call.n for call in calls) for calls in (lost, kept)]
    assert [worker_load(stack, i).running for i in range(2)] == sequences, "each call where it was placed"
    assert sum(sequences) == 16
    return lost, kept


def lose_a_worker(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, reference: list[Call], how: signal.Signals
) -> None:
    """Run the calls, lose worker-0 to `how` while it holds every kind; check what clients got."""
    wait_until(lambda: links_up(stack), 120, "the frontend's links to both workers")
    # The pages of calls just ended reach the daemon a moment after their last response: held, a flush
    # would leave them, to be cached after it.
    wait_until(lambda: books_balance(stack), 60, "every page back before the flush", 0.2)
    flush_prefix_cache(stack)
    hits, moved = pool_counts(stack.daemon_address).prefix_hit_pages, failovers(stack, "moved")
    restarts = stack.log().count("worker-0 is back")
    lost, kept = place(stack, stub, reference)
    assert set().union(*(kinds(call.request) for call in lost)) >= {
        "greedy", "seeded", "stop string", "structured", "n > 1"
    }  # fmt: skip
    pid = pid_of_worker(stack, 0)
    lead = max(len(call.token_ids(i)) for call in lost for i in range(call.n))
    os.kill(pid, how)
    try:
        finish(lost + kept)
    finally:
        if how == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)
    assert lead < STOP_AFTER - 8, f"a stream had {lead} tokens at the loss: no stop string struck before it"
    for i, (call, expected) in enumerate(zip(lost + kept, reference, strict=True)):
        assert_same(call, expected, f"{NAMES[i]} from worker-{int(i >= LOST)}")
        for index in range(call.n):  # as the first worker found the flushed cache; a later sample follows
            prompt = len(call.request.prompt_token_ids)
            cached = (prompt - 1) // PAGE * PAGE if index else 0
            assert call.sample(index)[-1].usage.cached_prompt_tokens == cached
    on_lost = sum(call.n for call in lost)
    assert failovers(stack, "moved") - moved == on_lost
    # Each moved stream finds at least its prompt's full pages and its first tokens' (40 + 24 tokens: 4
    # pages) in the cache, published by the lost worker; the prompts are distinct, so only the n = 2 call's
    # second sample hits besides.
    assert pool_counts(stack.daemon_address).prefix_hit_pages - hits >= 3 * on_lost
    if how == signal.SIGKILL:
        wait_until(
            lambda: stack.log().count("worker-0 is back") > restarts, 120, "the killed worker's restart"
        )
    wait_until(lambda: links_up(stack), 120, "the frontend's links to both workers")
    wait_until(lambda: books_balance(stack), 60, "every page back, the books balanced", 0.2)


def test_a_killed_workers_streams_go_on_elsewhere_token_for_token(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, reference: list[Call]
) -> None:
    lose_a_worker(stack, stub, reference, signal.SIGKILL)


def test_a_frozen_workers_streams_go_on_elsewhere_after_the_timeout(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, reference: list[Call]
) -> None:
    moving = f"worker {stack.worker_address(0)}: silent for "
    moves = stack.log().count(moving)
    lose_a_worker(stack, stub, reference, signal.SIGSTOP)
    assert stack.log().count(moving) == moves + 1


def test_a_request_that_kills_every_worker_is_given_up(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub
) -> None:
    wait_until(lambda: links_up(stack), 120, "the frontend's links to both workers")
    given_up, restarts = failovers(stack, "given_up"), stack.log().count("is back")
    (call,) = start(stub, [generate_request(token_ids=[5000, 6000, 7000], max_tokens=4000, ignore_eos=True)])
    killed: list[int] = []
    for _ in range(2):  # --max-failovers 1: the second worker it kills is the last
        tokens = len(call.token_ids())
        (busy,) = wait_until(
            lambda tokens=tokens: (
                len(call.token_ids()) > tokens
                and [i for i in range(2) if i not in killed and worker_load(stack, i).running]
            ),
            60,
            "the request to stream from a worker it has not killed yet",
        )
        os.kill(pid_of_worker(stack, busy), signal.SIGKILL)
        killed.append(busy)
    finish([call])
    assert call.code == grpc.StatusCode.INTERNAL, call.details
    assert "given up" in call.details and "--max-failovers" in call.details
    assert call.token_ids(), "it ran on both workers"
    assert failovers(stack, "given_up") - given_up == 1
    wait_until(lambda: stack.log().count("is back") == restarts + 2, 120, "both workers' restarts")
    wait_until(lambda: links_up(stack), 120, "the frontend's links to both workers")
    wait_until(lambda: books_balance(stack), 60, "every page back, the books balanced", 0.2)
