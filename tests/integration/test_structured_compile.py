"""A grammar that takes seconds to compile, on a real stack's worker, over a Connect stream as a frontend
holds it: it is compiled on the worker's compiler thread, so requests without one, another structured
request's intake, and the worker's heartbeats go on meanwhile; a request aborted during the compile ends
ABORT without a token and leaves nothing behind, and one aborted while its compile waits is never compiled.

The worker reads a stream's messages in order, and a message's submits before its aborts: that, and the
outputs of requests sent after the slow one, order the events; no test sleeps.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.worker.v1 import worker_pb2
from tests.clients import Scrape, wait_for_every_page
from tests.integration.streams import wait_for_idle_worker, worker_load
from tests.integration.worker_stream import WorkerStream, submit_of, tokens
from tests.procs import Stack, module_stack

# About 1500 optional integer properties: seconds for xgrammar to compile, far under the 64 KiB bound.
SLOW_SCHEMA = json.dumps(
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}
)
PROMPT = [32, 9485, 1743, 42]  # any few tokens


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--kv-memory", "256MiB") as running:
        yield running


@pytest.fixture
def stream(stack: Stack) -> Iterator[WorkerStream]:
    connection = WorkerStream(stack.worker_address())
    yield connection
    connection.close()


def slow(max_tokens: int, schema: str = SLOW_SCHEMA) -> pb.SamplingParams:
    structured = pb.StructuredOutput(json_schema=schema)
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, structured=structured)


def free(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def compiles(stack: Stack) -> float:
    """How many constraints the worker has compiled (cache misses)."""
    return Scrape(stack.metrics_url("worker"))("pagedserve_worker_grammar_compile_seconds_count")


def test_requests_without_a_grammar_pass_a_slow_compile(stack: Stack, stream: WorkerStream) -> None:
    # One message: the constrained request reaches the worker first. Once "free" is done, its compile is
    # under way, and "queued" (another constraint, which waits for the compiler) and "later" come in the
    # middle of it. Taking "queued" in once waited for the compile, and stopped the worker's event loop.
    submits = [submit_of("slow", PROMPT, slow(8)), submit_of("free", PROMPT, free(4))]
    stream.send(worker_pb2.WorkerRequest(submit=submits))
    queued = pb.StructuredOutput(regex="(yes|no) sir")
    events: list[str] = []
    while not {"slow done", "queued done", "later done"} <= set(events):
        message = stream.next_message()
        if not message.outputs:
            events.append("heartbeat")
        for output in message.outputs:
            events.append(output.request_id + (" done" if output.finish_reason else ""))
            if events[-1] == "free done":
                structured = pb.SamplingParams(max_tokens=4, temperature=0, structured=queued)
                submits = [submit_of("queued", PROMPT, structured), submit_of("later", PROMPT, free(4))]
                stream.send(worker_pb2.WorkerRequest(submit=submits))
    free_done = events.index("free done")
    constrained = next(i for i, event in enumerate(events) if event.startswith("slow"))
    assert free_done < events.index("later done") < constrained, events  # done while the grammar compiled
    # A compile that held up the worker's event loop would leave room for one overdue beat at most.
    assert events[free_done:constrained].count("heartbeat") >= 2, events
    wait_for_idle_worker(stack)
    wait_for_every_page(stack.daemon_address)


def test_requests_aborted_during_or_before_their_compile_leave_nothing_behind(
    stack: Stack, stream: WorkerStream
) -> None:
    schema = SLOW_SCHEMA.replace('"p0"', '"q0"')  # not in the cache
    compiled = compiles(stack)
    stream.submit("abandoned", PROMPT, slow(2000, schema))
    stream.submit("never compiled", PROMPT, slow(2000, SLOW_SCHEMA.replace('"p0"', '"r0"')))  # waits for it
    # Once a later request's outputs are back, the worker has read the submits and a compile is under way.
    stream.submit("probe", PROMPT, free(1))
    before = stream.collect({"probe"})
    stream.abort("abandoned")
    stream.abort("never compiled")
    # The same schema again, short: it waits on the compiler thread for the first compile, then finds it in
    # the cache. By then the abandoned request would be running, had the worker submitted it.
    stream.submit("again", PROMPT, slow(2, schema))
    after = stream.collect({"again"})
    assert len(tokens(after["again"])) == 2
    for request_id in ("abandoned", "never compiled"):
        outputs = before.get(request_id, []) + after.get(request_id, [])
        if not any(output.finish_reason for output in outputs):  # its ABORT may come after "again" ends
            outputs += stream.collect({request_id})[request_id]
        # It ended as aborted, in a grammar's compile state: no token, so it never ran.
        ended = [(output.finish_reason, list(output.token_ids)) for output in outputs]
        assert ended == [(pb.GenerateResponse.FinishReason.ABORT, [])], request_id
    # "again" found the abandoned request's grammar; the other compile was called off before it began, where
    # it once ran to its end for no one, and every structured request waited behind it.
    assert compiles(stack) - compiled == 1
    load = worker_load(stack)
    assert (load.running, load.waiting) == (0, 0), load
    wait_for_idle_worker(stack)
    wait_for_every_page(stack.daemon_address)
