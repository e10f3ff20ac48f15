"""For the failover tests: streamed calls in threads, read per sample, and where the frontend routes them.

A call started while one worker is SIGSTOPped and routed around (`routed_around`) can only be served by the
other one: that is how tests/integration/test_failover.py knows which worker holds each stream.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from tests.procs import Stack
from tests.waiting import wait_until


@dataclass
class Call:
    """One streamed call in a thread: its responses, and how it ended."""

    request: pb.GenerateRequest
    responses: list[pb.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""

    @property
    def n(self) -> int:
        return self.request.sampling.n if self.request.sampling.HasField("n") else 1

    def sample(self, index: int = 0) -> list[pb.GenerateResponse]:
        return [r for r in list(self.responses) if r.index == index]

    def token_ids(self, index: int = 0) -> list[int]:
        return [t for r in self.sample(index) for t in r.token_ids]

    def text(self, index: int = 0) -> str:
        return "".join(r.text for r in self.sample(index))

    def fewest_tokens(self) -> int:
        """The tokens its slowest sample has had."""
        return min(len(self.token_ids(i)) for i in range(self.n))

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


def streaming(calls: list[Call], tokens: int) -> bool:
    """Whether every sample of every call has had `tokens` tokens; a call that ended is a failure here."""
    ended = [call.details or str(call.code) for call in calls if call.code is not None]
    assert not ended, f"calls ended before the test was ready for them: {ended}"
    return all(call.fewest_tokens() >= tokens for call in calls)


def assert_same(call: Call, expected: Call, what: str) -> None:
    """Every sample of call as in expected, token for token: text, finish, stop, usage and logprobs."""
    assert call.code == grpc.StatusCode.OK, f"{what}: {call.details}"
    for index in range(expected.n):
        got, want, where = call.sample(index), expected.sample(index), f"{what}, sample {index}"
        assert call.token_ids(index) == expected.token_ids(index), where
        assert call.text(index) == expected.text(index), where
        last, expected_last = got[-1], want[-1]
        assert last.finish_reason == expected_last.finish_reason
        assert last.matched_stop_str == expected_last.matched_stop_str
        usage, expected_usage = last.usage, expected_last.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            expected_usage.prompt_tokens,
            expected_usage.completion_tokens,
        )
        logprobs = [lp for r in got for lp in r.logprobs]
        asked = len(call.token_ids(index)) if call.request.sampling.logprobs else 0
        assert len(logprobs) == asked, f"{where}: {len(logprobs)} logprobs for {asked} tokens"
        for lp, expected_lp in zip(logprobs, [lp for r in want for lp in r.logprobs], strict=True):
            assert lp.token_id == expected_lp.token_id
            assert lp.logprob == pytest.approx(expected_lp.logprob, abs=1e-3)


def pid_of_worker(stack: Stack, index: int) -> int:
    (pid,) = [int(line.split()[0]) for line in stack.survivors() if f"--name worker-{index} " in line]
    return pid


@contextlib.contextmanager
def routed_around(stack: Stack, index: int) -> Iterator[None]:
    """Worker `index` SIGSTOPped, until the frontend has noticed its silence and routes new calls to the
    others; on exit it goes on, and the frontend has heard from it again."""
    address = stack.worker_address(index)
    silent, heard = f"worker {address}: it has sent nothing", f"worker {address}: speaks again"
    log = stack.log()
    silences, hearings = log.count(silent), log.count(heard)
    pid = pid_of_worker(stack, index)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: stack.log().count(silent) > silences, 30, f"the frontend to route around {address}"
        )
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: stack.log().count(heard) > hearings, 30, f"the frontend to hear from {address} again")
