"""Faults on a real stack: a worker SIGKILLed mid-stream, the daemon killed, clients vanishing under load.

`pagedserve up` restarts what dies; the tests check what callers see meanwhile, that no page leaks, and
that the stack serves again, the prefix cache included when only a worker died.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.plumbing.rpc import wait_for_health
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.client import generate_request
from services.common.default_model import default_model_dir
from tests.clients import every_page_accounted, internal_channel
from tests.procs import REPO, Stack, start_stack
from tests.waiting import wait_until

LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0.0}
PROMPT = {"messages": [{"role": "user", "content": "Tell me about the history of Paris. " * 6}]}


@pytest.fixture(scope="module", autouse=True)
def model() -> None:
    default_model_dir()


def pid_of(stack: Stack, name: str) -> int:
    line = next(
        line for line in stack.survivors() if f"services.cli {name}" in line or f"--name {name}" in line
    )
    return int(line.split()[0])


def worker_load(stack: Stack, index: int = 0) -> worker_pb2.Load:
    with internal_channel(stack.worker_address(index)) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def worker_idle(stack: Stack) -> bool:
    load = worker_load(stack)
    return load.running == 0 and load.kv_pages_in_use == 0


def every_page_back(stack: Stack) -> Callable[[], bool]:
    return lambda: worker_idle(stack) and every_page_accounted(stack.daemon_address)


def serves_again_after_reattaching(stack: Stack, stub: generation_pb2_grpc.GenerationStub) -> None:
    """The worker leases anew, the stack answers a request, and every page comes back."""
    wait_until(
        lambda: "re-attached to the memory daemon" in stack.log(),
        60,
        "the worker re-attaching",
        interval_s=0.1,
    )
    wait_for_health(stack.address, 30, service="pagedserve.v1.Generation")
    reply = stub.Complete(generate_request(**PROMPT, max_tokens=4, temperature=0.0))
    assert reply.usage.completion_tokens == 4
    wait_until(every_page_back(stack), 60, "every page back", interval_s=0.1)


class Streams:
    """Long streaming calls in threads: each records its final status and when it ended."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, count: int) -> None:
        self.started = threading.Barrier(count + 1)
        self.ended: list[tuple[grpc.StatusCode, str, float]] = []
        self.threads = [threading.Thread(target=self._run, args=(stub,)) for _ in range(count)]
        for thread in self.threads:
            thread.start()
        self.started.wait(timeout=120)  # every call has its first tokens

    def _run(self, stub: generation_pb2_grpc.GenerationStub) -> None:
        call = stub.Generate(generate_request(**PROMPT, **LONG))
        first = True
        try:
            for _ in call:
                if first:
                    self.started.wait(timeout=120)
                    first = False
            self.ended.append((grpc.StatusCode.OK, "", time.monotonic()))
        except grpc.RpcError as exc:
            self.ended.append((exc.code(), exc.details(), time.monotonic()))

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=60)


def test_a_killed_worker_fails_its_streams_fast_leaks_nothing_and_comes_back(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--kv-memory", "256MiB")
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            first = stub.Complete(generate_request(**PROMPT, max_tokens=8, temperature=0.0))
            streams = Streams(stub, 4)
            killed = time.monotonic()
            os.kill(pid_of(stack, "worker-0"), signal.SIGKILL)
            streams.join()
            assert len(streams.ended) == 4
            for code, details, ended in streams.ended:
                assert code == grpc.StatusCode.UNAVAILABLE, details
                assert "went away" in details
                assert ended - killed < 2.0, f"a stream took {ended - killed:.2f}s to fail"
            wait_until(lambda: "worker-0 is back" in stack.log(), 60, "the worker's restart", interval_s=0.1)
            wait_until(every_page_back(stack), 60, "every page back", interval_s=0.1)
            assert "worker-0 killed by SIGKILL; starting it again" in stack.log()
            wait_for_health(stack.address, 30, service="pagedserve.v1.Generation")  # the frontend reconnected
            again = stub.Complete(generate_request(**PROMPT, max_tokens=8, temperature=0.0))
        assert again.token_ids == first.token_ids
        assert first.usage.cached_prompt_tokens == 0
        assert again.usage.cached_prompt_tokens > 0  # the daemon kept the dead worker's prefix pages
    finally:
        assert stack.stop() == 0
    assert not stack.survivors()


def test_a_killed_daemon_gives_clear_errors_and_the_stack_recovers(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--kv-memory", "256MiB")
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            streams = Streams(stub, 2)
            os.kill(stack.proc.pid, signal.SIGSTOP)  # hold the launcher: the daemon stays dead for now
            try:
                os.kill(pid_of(stack, "daemon"), signal.SIGKILL)
                streams.join()
                assert len(streams.ended) == 2, "a stream did not end within a minute of the daemon's death"
                for code, details, _ in streams.ended:
                    assert code == grpc.StatusCode.UNAVAILABLE, details
                    assert "memory daemon" in details
                # The worker is up but refuses requests, so the frontend is NOT_SERVING and says why.
                health = health_pb2_grpc.HealthStub(channel)
                check = health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation")
                wait_until(
                    lambda: health.Check(check).status == health_pb2.HealthCheckResponse.NOT_SERVING,
                    60,
                    "the frontend reporting NOT_SERVING",
                    interval_s=0.1,
                )
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Complete(generate_request("Hi", max_tokens=2))
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no worker accepts requests now" in caught.value.details()
                assert "the KV memory daemon went away" in caught.value.details()
            finally:
                os.kill(stack.proc.pid, signal.SIGCONT)
            serves_again_after_reattaching(stack, stub)
        assert "daemon killed by SIGKILL; starting it again" in stack.log()
    finally:
        assert stack.stop() == 0
    assert not stack.survivors()


def test_a_stopped_daemon_ends_each_lease_saying_why_and_the_worker_attaches_to_the_next(
    tmp_path: Path,
) -> None:
    """SIGTERM: the daemon ends its leases' streams itself, UNAVAILABLE with its reason, before its server
    stops; the server's stop used to cancel them, which workers logged as "Cancelling all calls" and grpc
    as an unhandled CancelledError of the daemon's, with a traceback."""
    stack = start_stack(tmp_path, "--kv-memory", "256MiB")
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            os.kill(pid_of(stack, "daemon"), signal.SIGTERM)
            serves_again_after_reattaching(stack, stub)
        assert "the memory daemon ended the lease: the memory daemon is shutting down" in stack.log()
        assert "daemon exited with status 0; starting it again" in stack.log()
        assert "Traceback" not in stack.log() and "Cancelling all calls" not in stack.log()
    finally:
        assert stack.stop() == 0
    assert not stack.survivors()


def test_a_paused_daemon_fails_the_call_waiting_on_it_and_the_worker_serves_again_once_it_moves(
    tmp_path: Path,
) -> None:
    """A daemon that stops answering for longer than a call's deadline (SIGSTOP here; a swap storm or a
    debugger elsewhere) fails the request whose step waited on it, UNAVAILABLE. Its lease's stream
    never broke, yet once it moves again the worker leases anew and serves, and the old lease's pages come
    back: a worker that only suspended itself stayed suspended for good."""
    stack = start_stack(tmp_path, "--kv-memory", "256MiB")
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            daemon = pid_of(stack, "daemon")
            os.kill(daemon, signal.SIGSTOP)
            try:
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Complete(generate_request("A prompt no one sent before", max_tokens=2), timeout=60)
                # The frontend may give up on the silent worker first (--worker-timeout): either way, retry.
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
                wait_until(  # the step's call (a lease, a lookup) ran out of time: the pool counts as lost
                    lambda: "DEADLINE_EXCEEDED" in stack.log().partition("lost the KV pool: ")[2],
                    60,
                    "the worker's call to the daemon timing out",
                    interval_s=0.1,
                )
            finally:
                os.kill(daemon, signal.SIGCONT)
            serves_again_after_reattaching(stack, stub)
        assert pid_of(stack, "daemon") == daemon  # the same daemon: nothing was restarted
    finally:
        assert stack.stop() == 0
    assert not stack.survivors()


def test_a_step_waiting_on_a_paused_daemon_for_pages_leaves_the_worker_answering(tmp_path: Path) -> None:
    """Streams that run out of leased pages under a paused daemon wait in their step's Lease for its 10 s
    deadline. The lease used to hold the lock that the worker's load report takes, so that the worker
    stopped answering (its frontend saw it silent, not why); now it answers throughout, and says why."""
    stack = start_stack(tmp_path, "--kv-memory", "256MiB")
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            calls = [stub.Generate(generate_request(f"Story {i}:", **LONG)) for i in range(8)]
            for call in calls:
                next(call)
            daemon = pid_of(stack, "daemon")
            os.kill(daemon, signal.SIGSTOP)
            try:
                with internal_channel(stack.worker_address()) as worker:
                    stub_of_worker = worker_pb2_grpc.WorkerStub(worker)
                    reasons, deadline = set(), time.monotonic() + 60
                    while "Lease: DEADLINE_EXCEEDED" not in stack.log().partition("lost the KV pool: ")[2]:
                        # It answers in 2 s, or DEADLINE_EXCEEDED fails the test.
                        load = stub_of_worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
                        reasons.add(load.unavailable)
                        assert time.monotonic() < deadline, "the step's lease never ran out of time"
                        time.sleep(0.2)
            finally:
                os.kill(daemon, signal.SIGCONT)
            assert any(reason.startswith("the engine has been in one step for") for reason in reasons)
            for call in calls:
                with pytest.raises(grpc.RpcError) as caught:
                    list(call)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
            serves_again_after_reattaching(stack, stub)
    finally:
        assert stack.stop() == 0
    assert not stack.survivors()


def test_a_stopping_worker_finishes_its_requests_and_takes_no_new_one(tmp_path: Path) -> None:
    """SIGTERM: the worker tells its frontend at once that it is shutting down, so that new requests go to
    the other worker, finishes the request it runs, then ends the stream saying why. It used to take
    requests through its 5 s of grace (and stop them at its end), and held its idle streams for all of it."""
    stack = start_stack(tmp_path, "--workers", "2", "--kv-memory", "256MiB")
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            running = stub.Generate(generate_request(**PROMPT, max_tokens=48, ignore_eos=True, temperature=0))
            first = next(running)
            busy = next(i for i in (0, 1) if worker_load(stack, i).running == 1)
            os.kill(pid_of(stack, f"worker-{busy}"), signal.SIGTERM)
            address = stack.worker_address(busy)
            news = f"worker {address}: the worker is shutting down"
            wait_until(lambda: news in stack.log(), 30, "the frontend told the worker is stopping")
            for _ in range(3):  # while the stopping worker finishes its request
                assert stub.Complete(generate_request(**PROMPT, max_tokens=2)).usage.completion_tokens == 2
            rest = list(running)
            assert rest[-1].finish_reason == pb.GenerateResponse.LENGTH
            assert sum(len(response.token_ids) for response in [first, *rest]) == 48
        ended = f"worker {address} went away: UNAVAILABLE: the worker is shutting down"
        wait_until(lambda: ended in stack.log(), 30, "the stream's end, saying why")
        assert "moving a request to" not in stack.log()  # the stopping worker finished it itself
    finally:
        assert stack.stop() == 0
    assert not stack.survivors()


CLIENT = """
import sys, threading, grpc
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
requests = [generate_request(prompt=f"Story {i}:", max_tokens=2000, ignore_eos=True) for i in range(24)]
calls = [stub.Generate(request) for request in requests]
for call in calls:
    next(call)
print("streaming", flush=True)
threading.Event().wait()
"""


def test_clients_that_vanish_under_load_return_every_page(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--kv-memory", "256MiB")
    try:
        client = subprocess.Popen(
            [sys.executable, "-c", CLIENT, stack.address], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        assert client.stdout is not None and client.stdout.readline().strip() == "streaming"
        with internal_channel(stack.worker_address()) as channel:
            running = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest()).running
        assert running == 24
        client.kill()  # 24 streams gone without a goodbye
        client.wait()
        wait_until(every_page_back(stack), 30, "every page back", interval_s=0.1)
    finally:
        assert stack.stop() == 0
