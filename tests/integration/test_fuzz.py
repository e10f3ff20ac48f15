"""Property-based fuzzing, with hypothesis, of the public GenerateRequest and the internal contracts, against
real processes: every call gets OK or a clear status, every process stays healthy, and no page leaks."""

from __future__ import annotations

import queue
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memory_daemon.wire import counts_from_pb
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.clients import internal_channel, pool_counts, wait_for_every_page
from tests.models import make_model
from tests.procs import DaemonProcess, Stack, start_daemon, start_stack
from tests.waiting import wait_until

C = grpc.StatusCode
PUBLIC_CASES, DAEMON_CASES, ATTACH_CASES, WORKER_CASES = 300, 150, 80, 120
FUZZ = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
floats = st.floats(width=32)  # NaN and infinities included
text = st.text(max_size=64)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    run_dir = Path(tempfile.mkdtemp(prefix="ps-"))
    model = make_model("qwen2-bias", run_dir / "model")  # context 512: even valid requests end fast
    running = start_stack(run_dir, "--model", str(model), "--kv-memory", "64MiB")
    yield running
    assert running.stop() == 0, running.log()
    shutil.rmtree(run_dir, ignore_errors=True)


def healthy(address: str, channel_for: Callable[[str], grpc.Channel] = grpc.insecure_channel) -> bool:
    with channel_for(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def mostly(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """A value that passes validation nine times in ten: a request sets a dozen fields, and both sides of
    validation must be reached."""
    return st.integers(0, 9).flatmap(lambda roll: anything if roll == 0 else valid)


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    optional = {
        "max_tokens": mostly(st.integers(1, 16), int32),
        "temperature": mostly(st.floats(0, 2), floats),
        "top_p": mostly(st.floats(0.01, 1), floats),
        "repetition_penalty": mostly(st.floats(0.5, 2), floats),
        "seed": int64,
    }
    values = {name: draw(st.none() | strategy) for name, strategy in optional.items()}
    return pb.SamplingParams(
        **{name: value for name, value in values.items() if value is not None},
        top_k=draw(mostly(st.integers(-1, 50), int32)),
        min_p=draw(mostly(st.floats(0, 1), floats)),
        presence_penalty=draw(mostly(st.floats(-2, 2), floats)),
        frequency_penalty=draw(mostly(st.floats(-2, 2), floats)),
        stop=draw(mostly(st.lists(st.text(min_size=1, max_size=8), max_size=3), st.lists(text, max_size=20))),
        stop_token_ids=draw(st.lists(mostly(st.integers(0, 511), st.integers(0, 2**32 - 1)), max_size=70)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(mostly(st.integers(0, 5), int32)),
    )


roles = st.sampled_from(["system", "user", "assistant", "tool", "", "wizard"]) | text
token_lists = st.lists(mostly(st.integers(0, 511), st.integers(0, 2**32 - 1)), max_size=40)
chats = st.lists(st.builds(pb.ChatMessage, role=roles, content=text), max_size=3)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    inputs = {"prompt": text, "prompt_token_ids": token_lists, "messages": chats}
    chosen = draw(mostly(st.sampled_from(list(inputs)), st.lists(st.sampled_from(list(inputs)), unique=True)))
    chosen = [chosen] if isinstance(chosen, str) else chosen
    return pb.GenerateRequest(
        request_id=draw(mostly(st.text(max_size=32), st.text(max_size=300))),
        sampling=draw(sampling_params()),
        priority=draw(mostly(st.integers(0, 1000), int32)),  # the frontend takes 0..1000
        **{name: draw(inputs[name]) for name in chosen},
    )


def test_fuzzed_generate_requests(stack: Stack) -> None:
    seen: dict[str, int] = {}
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        @settings(FUZZ, max_examples=PUBLIC_CASES)
        @given(request=generate_requests())
        def call(request: pb.GenerateRequest) -> None:
            try:
                reply = stub.Complete(request, timeout=30)
                code = C.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert code in (C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED), (code, exc.details(), request)
                assert exc.details(), "a refusal must say why"
            else:
                assert reply.finish_reason != pb.GenerateResponse.FINISH_REASON_UNSPECIFIED
                assert reply.usage.completion_tokens == len(reply.token_ids) >= 1
            seen[code.name] = seen.get(code.name, 0) + 1

        call()
    print(f"{PUBLIC_CASES} fuzzed GenerateRequests: {seen}")
    assert seen.get("OK") and seen.get("INVALID_ARGUMENT")  # both sides of validation were reached
    assert healthy(stack.address) and healthy(stack.worker_address(), internal_channel)
    wait_for_every_page(stack.daemon_address)


REFUSALS = (C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.PERMISSION_DENIED, C.RESOURCE_EXHAUSTED)
pages = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 40), max_size=12)
keys = st.binary(max_size=80)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("lease"), int64 | st.integers(0, 8), int64 | st.integers(0, 8), int64),
        st.tuples(st.just("update"), st.lists(st.tuples(keys, st.integers(0, 40)), max_size=4), pages, pages),
        st.tuples(st.just("lookup"), st.lists(keys, max_size=6)),
        st.tuples(st.just("stranger"), st.text(max_size=40)),
    ),
    max_size=8,
)


@pytest.fixture(scope="module")
def fuzz_daemon() -> Iterator[DaemonProcess]:
    run_dir = Path(tempfile.mkdtemp(prefix="ps-"))
    daemon = start_daemon(run_dir, "--max-memory", "64MiB", "--pool-memory", "1MiB")
    yield daemon
    assert daemon.stop() == 0, daemon.log()
    shutil.rmtree(run_dir, ignore_errors=True)


def test_fuzzed_daemon_calls_keep_the_books_exact(fuzz_daemon: DaemonProcess) -> None:
    shape = memory_pb2.PoolShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", page_size=4)
    attach = memory_pb2.AttachRequest(worker_name="fuzz", model_id="fuzz", shape=shape, num_pages=41)
    with internal_channel(fuzz_daemon.address) as channel:
        stub = memory_pb2_grpc.MemoryDaemonStub(channel)

        @settings(FUZZ, max_examples=DAEMON_CASES)
        @given(ops=operations)
        def session(ops: list[tuple]) -> None:
            stream = stub.Attach(attach)
            lease = next(stream).attached.lease_id
            try:
                for op, *args in ops:
                    try:
                        if op == "lease":
                            stub.Lease(
                                memory_pb2.LeaseRequest(
                                    lease_id=lease, need=args[0], consumed=args[1], idle=args[2]
                                )
                            )
                        elif op == "update":
                            published = [memory_pb2.PublishedPage(key=k, page=p) for k, p in args[0]]
                            stub.Update(
                                memory_pb2.UpdateRequest(
                                    lease_id=lease, publish=published, unref=args[1], release=args[2]
                                )
                            )
                        elif op == "lookup":
                            stub.LookupPrefix(memory_pb2.LookupRequest(lease_id=lease, keys=args[0]))
                        else:
                            stub.Lease(memory_pb2.LeaseRequest(lease_id=args[0], need=1))
                    except grpc.RpcError as exc:
                        assert exc.code() in REFUSALS, (exc.code(), exc.details())
                    counts = counts_from_pb(stub.GetStats(memory_pb2.GetStatsRequest()).pools[0])
                    assert counts.free_pages + counts.leased_pages + counts.shared_pages == counts.total_pages
            finally:
                stream.cancel()

        session()
    assert healthy(fuzz_daemon.address)
    counts = wait_until(  # every lease ends with its stream
        lambda: None if (now := pool_counts(fuzz_daemon.address)).workers else now,
        10,
        lambda: f"every lease to end with its stream: {pool_counts(fuzz_daemon.address)}",
        interval_s=0.05,
    )
    assert counts.leased_pages == 0 and counts.free_pages + counts.shared_pages == counts.total_pages


shapes = st.builds(
    memory_pb2.PoolShape,
    num_layers=st.integers(0, 2**32 - 1) | st.integers(0, 4),
    num_kv_heads=st.integers(0, 2**32 - 1) | st.integers(0, 4),
    head_dim=st.integers(0, 2**32 - 1) | st.integers(0, 64),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]) | text,
    page_size=st.integers(0, 2**32 - 1) | st.integers(0, 32),
)
attaches = st.builds(
    memory_pb2.AttachRequest,
    worker_name=text,
    model_id=text,
    shape=shapes,
    num_pages=int64 | st.integers(0, 64),
    device=st.sampled_from(["", "cpu", "cuda"]) | text,
)


def test_fuzzed_attach_requests(fuzz_daemon: DaemonProcess) -> None:
    with internal_channel(fuzz_daemon.address) as channel:
        stub = memory_pb2_grpc.MemoryDaemonStub(channel)

        @settings(FUZZ, max_examples=ATTACH_CASES)
        @given(request=attaches)
        def attach(request: memory_pb2.AttachRequest) -> None:
            stream = stub.Attach(request)
            try:
                assert next(stream).attached.lease_id
            except grpc.RpcError as exc:
                assert exc.code() in REFUSALS, (exc.code(), exc.details())
            finally:
                stream.cancel()

        attach()
    assert healthy(fuzz_daemon.address)


submits = st.builds(
    worker_pb2.Submit,
    prompt_token_ids=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 600), max_size=30),
    sampling=st.builds(
        pb.SamplingParams,
        max_tokens=int32 | st.integers(1, 8),
        temperature=floats,
        top_p=floats,
        top_k=int32,
        min_p=floats,
        repetition_penalty=floats,
        presence_penalty=floats,
        frequency_penalty=floats,
        stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=5),
        ignore_eos=st.booleans(),
        logprobs=int32,
    ),
    priority=int32,
)


def test_fuzzed_worker_submits(stack: Stack) -> None:
    with internal_channel(stack.worker_address()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        requests: queue.Queue[worker_pb2.WorkerRequest | None] = queue.Queue()
        replies = stub.Connect(iter(requests.get, None))
        counter = iter(range(10**9))

        @settings(FUZZ, max_examples=WORKER_CASES)
        @given(submit=submits)
        def one(submit: worker_pb2.Submit) -> None:
            submit.request_id = str(next(counter))
            requests.put(worker_pb2.WorkerRequest(submit=[submit]))
            while True:
                outputs = [
                    o for reply in [next(replies)] for o in reply.outputs if o.request_id == submit.request_id
                ]
                final = [o for o in outputs if o.finish_reason]
                if final:
                    if final[0].error:
                        assert final[0].error_code == C.INVALID_ARGUMENT.value[0], final[0]
                    return

        one()
        requests.put(None)
    assert healthy(stack.worker_address(), internal_channel)
