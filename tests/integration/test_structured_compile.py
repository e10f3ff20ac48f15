"""A grammar that takes seconds to compile, on a real stack: it is compiled on the worker's compiler thread,
so requests without one, and the worker's heartbeats, go on meanwhile; a client that gives up during the
compile leaves nothing behind."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from tests.clients import every_page_accounted
from tests.integration.streams import wait_for_idle_worker
from tests.procs import Stack, module_stack

# About 1500 optional integer properties: seconds for xgrammar to compile, far under the 64 KiB bound.
SLOW_SCHEMA = json.dumps(
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}
)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--kv-memory", "256MiB") as running:
        yield running


def slow(max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, structured=pb.StructuredOutput(json_schema=SLOW_SCHEMA)
    )
    return pb.GenerateRequest(prompt="A JSON object:", sampling=sampling)


def test_requests_without_a_grammar_pass_a_slow_compile(stack: Stack) -> None:
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        events: list[str] = []

        def constrained() -> None:
            for response in stub.Generate(slow(8), timeout=300):
                events.append("constrained" if response.token_ids else "constrained-empty")

        thread = threading.Thread(target=constrained)
        thread.start()
        time.sleep(0.5)  # the constrained request reaches the worker first
        free = stub.Complete(pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=4)))
        events.append("free")
        thread.join(timeout=300)
    assert len(free.token_ids) == 4
    assert events[0] == "free" and "constrained" in events, events  # done while the grammar compiled
    wait_for_idle_worker(stack)
    assert every_page_accounted(stack.daemon_address)


def test_a_client_that_leaves_during_the_compile_leaves_nothing_behind(stack: Stack) -> None:
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        schema = SLOW_SCHEMA.replace('"p0"', '"q0"')  # not in the cache
        request = slow(2000)
        request.sampling.structured.json_schema = schema
        with pytest.raises(grpc.RpcError) as ended:
            list(stub.Generate(request, timeout=1.0))
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The same schema again, short: it waits on the compiler thread for the first compile, then finds it
        # in the cache. By then the abandoned request would be running, had the worker submitted it.
        again = slow(2)
        again.sampling.structured.json_schema = schema
        assert len(stub.Complete(again, timeout=300).token_ids) == 2
    wait_for_idle_worker(stack)
    assert every_page_accounted(stack.daemon_address)
