"""A worker lost mid-stream, and clients that never notice: two workers on one daemon, 16 streams, one worker
SIGKILLed or frozen with SIGSTOP. Every stream must end OK with exactly the tokens (and text, and finish)
of an uninterrupted run, the moved requests must find their pages in the daemon's prefix cache, and every
page must come back. A request that kills each worker it lands on is given up after --max-failovers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.clients import Scrape, every_page_accounted, internal_channel, pool_counts
from tests.integration.streams import worker_load
from tests.procs import Stack, module_stack
from tests.waiting import wait_until

STREAMS = 16
KILL_AFTER = 24  # tokens every stream has had when its worker is lost
FLAGS = ("--workers", "2", "--kv-memory", "512MiB", "--max-failovers", "1", "--worker-timeout", "3")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack(*FLAGS) as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@dataclass
class Call:
    """One streamed call in a thread: its responses, when each came, and how it ended."""

    request: pb.GenerateRequest
    responses: list[pb.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.responses for t in r.token_ids]

    @property
    def text(self) -> str:
        return "".join(r.text for r in self.responses)

    def run(self, stub: generation_pb2_grpc.GenerationStub) -> None:
        try:
            for response in stub.Generate(self.request, timeout=300):
                self.responses.append(response)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details()


def start(stub: generation_pb2_grpc.GenerationStub, requests: list[pb.GenerateRequest]) -> list[Call]:
    calls = [Call(request) for request in requests]
    for call in calls:
        threading.Thread(target=call.run, args=(stub,), daemon=True).start()
    return calls


def finish(calls: list[Call], timeout_s: float = 300) -> list[Call]:
    wait_until(lambda: all(call.code is not None for call in calls), timeout_s, "every call to end", 0.1)
    return calls


def requests(stops: dict[int, str] | None = None) -> list[pb.GenerateRequest]:
    """16 distinct random token prompts, so that only a failover finds pages in the prefix cache: greedy,
    seeded, with logprobs, with stop strings, penalties, a structured output."""
    rng = random.Random(17)
    made = []
    for i in range(STREAMS):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randrange(40, 70))]
        sampling: dict = {"max_tokens": 96, "ignore_eos": True, "temperature": 0.0}
        if i % 2:
            sampling |= {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
        if i % 4 == 2:
            sampling |= {"logprobs": 2}
        if i == 4:
            sampling |= {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5}
        if i == 6:
            sampling |= {"structured": pb.StructuredOutput(regex="[a-z]+( [a-z]+)*")}
        if stops and i in stops:
            sampling |= {"stop": [stops[i]]}
        made.append(generate_request(token_ids=prompt, **sampling))
    return made


def late_stops(calls: list[Call]) -> dict[int, str]:
    """For every fourth call, a stop string that first appears in its text after its 64th token."""
    stops = {}
    for i in range(3, STREAMS, 4):
        text, offset = calls[i].text, len("".join(r.text for r in calls[i].responses[:64]))
        for start_at in range(offset, len(text) - 4):
            candidate = text[start_at : start_at + 4]
            if candidate.strip() and text.find(candidate) == start_at:
                stops[i] = candidate
                break
    return stops


@pytest.fixture(scope="module")
def reference(stack: Stack, stub: generation_pb2_grpc.GenerationStub) -> list[Call]:
    """The 16 calls, uninterrupted, with stop strings that strike after any failover."""
    stops = late_stops(finish(start(stub, requests())))
    assert len(stops) == STREAMS // 4, stops
    calls = finish(start(stub, requests(stops)))
    assert all(call.code == grpc.StatusCode.OK for call in calls), [call.details for call in calls]
    assert all(calls[i].responses[-1].matched_stop_str == stop for i, stop in stops.items())
    assert all(len(call.token_ids) > KILL_AFTER + 8 for call in calls), "each is mid-stream at the loss"
    return calls


def links_up(stack: Stack) -> bool:
    """Whether the frontend has a link up to every worker since its latest start."""
    log = stack.log()
    return all(log.count(f"(worker-{i}) is up") > log.count(f"worker-{i} is back") for i in range(2))


def pid_of_worker(stack: Stack, index: int) -> int:
    (pid,) = [int(line.split()[0]) for line in stack.survivors() if f"--name worker-{index} " in line]
    return pid


def books_balance(stack: Stack) -> bool:
    """Both workers idle, every page accounted for, and the daemon's own audit of its books passes."""
    with internal_channel(stack.daemon_address) as channel:
        memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(memory_pb2.GetStatsRequest(check_invariants=True))
    loads = [worker_load(stack, i) for i in range(2)]
    return not any(load.running or load.kv_pages_in_use for load in loads) and every_page_accounted(
        stack.daemon_address
    )


def failovers(stack: Stack, outcome: str) -> float:
    endpoints = json.loads((stack.run_dir / "endpoints.json").read_text())
    return Scrape(endpoints["frontend"]["metrics"])("pagedserve_failovers_total", outcome=outcome)


def flush_prefix_cache(stack: Stack, stub: generation_pb2_grpc.GenerationStub) -> None:
    model_id = stub.GetModelInfo(pb.GetModelInfoRequest()).model_id
    with internal_channel(stack.daemon_address) as channel:
        memory_pb2_grpc.MemoryDaemonStub(channel).FlushPrefixIndex(
            memory_pb2.FlushPrefixIndexRequest(model_id=model_id)
        )


def lose_a_worker(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, reference: list[Call], how: signal.Signals
) -> None:
    """Run the 16 calls, lose worker-0 to `how` once each has KILL_AFTER tokens; check what clients got."""
    wait_until(lambda: links_up(stack), 120, "the frontend's links to both workers")
    flush_prefix_cache(stack, stub)
    hits, moved = pool_counts(stack.daemon_address).prefix_hit_pages, failovers(stack, "moved")
    calls = start(stub, [call.request for call in reference])
    wait_until(lambda: all(len(c.token_ids) >= KILL_AFTER or c.code for c in calls), 120, "tokens", 0.01)
    on_lost = worker_load(stack, 0).running
    assert on_lost >= 4, f"worker-0 runs {on_lost} of the calls: the test needs both workers busy"
    pid = pid_of_worker(stack, 0)
    os.kill(pid, how)
    try:
        finish(calls)
    finally:
        if how == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)
    for call, expected in zip(calls, reference, strict=True):
        assert call.code == grpc.StatusCode.OK, call.details
        assert call.token_ids == expected.token_ids
        assert call.text == expected.text
        assert call.responses[-1].finish_reason == expected.responses[-1].finish_reason
        usage, expected_usage = call.responses[-1].usage, expected.responses[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            expected_usage.prompt_tokens,
            expected_usage.completion_tokens,
        )
        assert usage.cached_prompt_tokens == 0  # as the first worker found the flushed cache
        for got, want in zip(
            [lp for r in call.responses for lp in r.logprobs],
            [lp for r in expected.responses for lp in r.logprobs],
            strict=True,
        ):
            assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-3)
    assert failovers(stack, "moved") - moved == on_lost
    # Each moved call finds at least its prompt's full pages and its first tokens' (40 + 24 tokens: 4 pages)
    # in the cache, published by the lost worker; the prompts are distinct, so nothing else could hit.
    assert pool_counts(stack.daemon_address).prefix_hit_pages - hits >= 3 * on_lost
    wait_until(lambda: books_balance(stack), 60, "every page back, the books balanced", 0.2)


def test_a_killed_workers_streams_go_on_elsewhere_token_for_token(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, reference: list[Call]
) -> None:
    lose_a_worker(stack, stub, reference, signal.SIGKILL)
    wait_until(lambda: "worker-0 is back" in stack.log(), 120, "the killed worker's restart")


def test_a_frozen_workers_streams_go_on_elsewhere_after_the_timeout(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, reference: list[Call]
) -> None:
    lose_a_worker(stack, stub, reference, signal.SIGSTOP)
    assert "has sent nothing for 3" in stack.log()


def test_a_request_that_kills_every_worker_is_given_up(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub
) -> None:
    wait_until(lambda: links_up(stack), 120, "the frontend's links to both workers")
    given_up, restarts = failovers(stack, "given_up"), stack.log().count("is back")
    (call,) = start(stub, [generate_request(token_ids=[5000, 6000, 7000], max_tokens=4000, ignore_eos=True)])
    killed: list[int] = []
    for _ in range(2):  # --max-failovers 1: the second worker it kills is the last
        tokens = len(call.token_ids)
        (busy,) = wait_until(
            lambda tokens=tokens: (
                len(call.token_ids) > tokens
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
    assert call.token_ids, "it ran on both workers"
    assert failovers(stack, "given_up") - given_up == 1
    wait_until(lambda: stack.log().count("is back") == restarts + 2, 120, "both workers' restarts")
    wait_until(lambda: links_up(stack), 120, "the frontend's links to both workers")
    wait_until(lambda: books_balance(stack), 60, "every page back, the books balanced", 0.2)
