"""One client cannot starve the others, on a real stack whose frontend has two clients' tokens: one opens
300 streams at the most favourable priority over two connections, HTTP/2 lets 100 a connection reach the
frontend (--max-concurrent-streams 100: the rest wait in the client), its share of admission keeps half
the slots free of it, and the other client's request is admitted and answered at once; a priority outside
the operator's range is refused; a message over the size limit is refused by gRPC before any handler
runs."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from tests.clients import Scrape, wait_for_every_page
from tests.integration.streams import wait_for_idle_worker
from tests.procs import Stack, start_stack
from tests.waiting import wait_until

TOKENS = {"greedy": "greedy-clients-token", "modest": "modest-clients-token"}
MAX_RUNNING, MAX_WAITING = 8, 600  # --client-share 0.5: a client runs 4 at most, and queues 300
# Its own connection each: gRPC Python shares one between channels with the same arguments otherwise.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 64 * 2**20)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("limits")
    tokens = folder / "tokens"
    tokens.write_text("# one client a line\n" + "\n".join(TOKENS.values()) + "\n")
    tokens.chmod(0o600)
    limits = [
        "--max-running",
        str(MAX_RUNNING),
        "--max-waiting",
        str(MAX_WAITING),
        "--max-concurrent-streams",
        "100",
    ]
    running = start_stack(folder, "--api-token-file", str(tokens), "--kv-memory", "256MiB", *limits)
    yield running
    assert running.stop() == 0, running.log()


def metadata(client: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[client]}"),)


def admission(stack: Stack) -> tuple[float, float]:
    """(running, waiting) as the frontend counts them."""
    scrape = Scrape(stack.metrics_url("frontend"))
    return scrape("pagedserve_requests_running"), scrape("pagedserve_requests_waiting")


def calls_ended(stack: Stack, code: str) -> float:
    scrape = Scrape(stack.metrics_url("frontend"))
    return scrape.samples.get(("pagedserve_requests_total", frozenset({("code", code)})), 0.0)


def test_a_client_with_300_streams_at_the_best_priority_leaves_room_for_another(stack: Stack) -> None:
    channels = [grpc.insecure_channel(stack.address, options=OWN_CONNECTION) for _ in range(2)]
    hog = pb.GenerateRequest(
        prompt_token_ids=list(range(100, 140)),
        sampling=pb.SamplingParams(max_tokens=4000, ignore_eos=True),
        priority=0,  # the most favourable this server takes
    )
    calls = [
        generation_pb2_grpc.GenerationStub(channel).Generate(hog, metadata=metadata("greedy"))
        for channel in channels
        for _ in range(150)
    ]
    try:
        # 100 streams a connection reach the frontend (HTTP/2's max_concurrent_streams): 4 run, 196 wait.
        wait_until(lambda: admission(stack) == (4, 196), 60, lambda: f"the hog's calls: {admission(stack)}")
        with grpc.insecure_channel(stack.address, options=OWN_CONNECTION) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
                priority=1000,
            )
            answer = stub.Complete(request, metadata=metadata("modest"), timeout=60)
        assert len(answer.token_ids) == 4 and answer.finish_reason == pb.GenerateResponse.LENGTH
        assert all(call.is_active() for call in calls)  # every hog's call still runs or waits
        with pytest.raises(grpc.RpcError) as refused:
            generation_pb2_grpc.GenerationStub(channels[0]).Complete(
                hog, metadata=metadata("greedy"), timeout=1
            )
        assert refused.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
    wait_until(lambda: admission(stack) == (0, 0), 60, "the hog's calls to end")
    wait_for_idle_worker(stack, timeout_s=60)
    wait_for_every_page(stack.daemon_address, 30)


@pytest.mark.parametrize("priority", [-1, -(2**31), 1001])
def test_a_priority_outside_the_range_is_refused(stack: Stack, priority: int) -> None:
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=1))
        request.priority = priority
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(request, metadata=metadata("greedy"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"priority is {priority}; this server takes 0 to 1000" in str(refused.value.details())


def test_a_message_over_the_limit_is_refused_before_any_handler_runs(stack: Stack) -> None:
    """4 MiB by default: a bigger message is refused by gRPC as it arrives, never parsed; one under the limit
    reaches the frontend's own size check (which counts the call it refuses)."""
    counted = calls_ended(stack, "RESOURCE_EXHAUSTED")
    with grpc.insecure_channel(stack.address, options=OWN_CONNECTION) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for size, refuser in ((5 * 2**20, "Received message larger than max"), (3 * 2**20, "characters")):
            request = pb.GenerateRequest(prompt="x" * size, sampling=pb.SamplingParams(max_tokens=1))
            with pytest.raises(grpc.RpcError) as refused:
                stub.Complete(request, metadata=metadata("modest"), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            assert refuser in str(refused.value.details())
    assert calls_ended(stack, "RESOURCE_EXHAUSTED") == counted + 1  # the parsed one only


def test_a_client_without_a_token_is_refused(stack: Stack) -> None:
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=1))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(request, metadata=(("authorization", "Bearer not-one-of-them"),))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
