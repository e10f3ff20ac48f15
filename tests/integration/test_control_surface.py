"""The node's control surface answers the gateway alone, on a real stack with a gateway listener
(--gateway-address): an anonymous client of the public port, over TCP or the frontend's own unix socket,
reads no token of another client's prompts, flushes nothing and aborts nothing; the gateway listener serves
all three to this user's processes; another local user (`nobody`) is refused there too."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from tests.clients import Scrape, pool_counts
from tests.procs import Stack, free_port, module_stack, start_stack
from tests.second_user import python_as_second_user
from tests.waiting import wait_until

# Another client's prompt: several full pages, so that the cache holds its tokens.
THEIR_PROMPT = list(range(1000, 1000 + 16 * 6))
NOBODY_CALLS = """
import sys, grpc
with grpc.insecure_channel(sys.argv[1]) as channel:  # raw bytes: an empty request of each RPC
    events = channel.unary_stream("/vllm.grpc.engine.VllmEngine/SubscribeKvEvents")
    flush = channel.unary_unary("/vllm.grpc.engine.VllmEngine/FlushCache")
    for call in (lambda: next(events(b"", timeout=10)), lambda: flush(b"", timeout=10)):
        try:
            print("ANSWERED", call())
        except grpc.RpcError as refused:
            print(refused.code().name, refused.details())
"""


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--gateway-address", f"127.0.0.1:{free_port()}", "--kv-memory", "256MiB") as running:
        yield running


def their_stream(stack: Stack, max_tokens: int) -> Iterator[pb.GenerateResponse]:
    """Another client's request, running: its prompt's pages are in the cache once its first token is out."""
    channel = grpc.insecure_channel(stack.address)
    request = pb.GenerateRequest(
        request_id="theirs",
        prompt_token_ids=THEIR_PROMPT,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    return generation_pb2_grpc.GenerationStub(channel).Generate(request)


def refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()  # type: ignore[operator]
        if hasattr(result, "__next__"):
            next(result)  # a stream's refusal comes with its first message
    return caught.value


def gateways_alone(rpc: str, call: Callable[[], object]) -> None:
    """The call is refused as a gateway's RPC, saying where a gateway connects."""
    error = refused(call)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (rpc, error)
    assert f"{rpc} is the gateway's alone" in str(error.details())
    assert "--gateway-address" in str(error.details())


@pytest.mark.parametrize("public", ["tcp", "local socket"])
def test_the_public_port_reads_no_prompt_flushes_nothing_and_aborts_nothing(
    stack: Stack, public: str
) -> None:
    theirs = their_stream(stack, max_tokens=64)
    first = next(theirs)
    full_pages = len(THEIR_PROMPT) // 16
    wait_until(lambda: pool_counts(stack.daemon_address).cached_pages >= full_pages, 10, "their pages cached")
    address = stack.address if public == "tcp" else f"unix:{stack.run_dir}/frontend.sock"
    with grpc.insecure_channel(address) as channel:
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        gateways_alone(
            "SubscribeKvEvents", lambda: vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        )
        gateways_alone("Abort", lambda: vllm.Abort(vllm_engine_pb2.AbortRequest(request_ids=["theirs"])))
        rest = list(theirs)
        assert rest[-1].finish_reason == pb.GenerateResponse.LENGTH  # not aborted
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 64
        # Their pages are idle now, so a flush would drop them.
        wait_until(lambda: pool_counts(stack.daemon_address).evictable_pages >= full_pages, 10, "idle pages")
        cached = pool_counts(stack.daemon_address).cached_pages
        gateways_alone("FlushCache", lambda: vllm.FlushCache(common_pb2.FlushCacheRequest()))
    assert pool_counts(stack.daemon_address).cached_pages >= cached  # nothing flushed (more may arrive)


def test_the_gateway_listener_serves_this_user_every_control_rpc(stack: Stack) -> None:
    list(their_stream(stack, max_tokens=1))
    wait_until(lambda: pool_counts(stack.daemon_address).cached_pages > 0, 10, "their pages cached")
    with grpc.insecure_channel(stack.gateway_address) as channel:
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        state = next(vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()))
        told = [t for e in state.events if e.WhichOneof("data") == "stored" for b in e.stored.blocks
                for t in b.token_ids]  # fmt: skip
        assert set(THEIR_PROMPT[:96]) <= set(told)
        long = vllm_engine_pb2.GenerateRequest(
            request_id="mine",
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=THEIR_PROMPT[:20]),
            sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2000, ignore_eos=True),
            stream=True,
        )
        call = vllm.Generate(long)
        next(call)
        vllm.Abort(vllm_engine_pb2.AbortRequest(request_ids=["mine"]))
        assert list(call)[-1].complete.finish_reason == "abort"
        assert "dropped" in vllm.FlushCache(common_pb2.FlushCacheRequest()).message


def test_another_local_user_is_refused_at_the_gateway_listener(stack: Stack) -> None:
    list(their_stream(stack, max_tokens=1))
    full_pages = len(THEIR_PROMPT) // 16
    wait_until(lambda: pool_counts(stack.daemon_address).cached_pages >= full_pages, 10, "their pages cached")
    cached = pool_counts(stack.daemon_address).cached_pages
    command = [*python_as_second_user(), "-c", NOBODY_CALLS, stack.gateway_address]
    said = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert len(said) == 2 and all(line.startswith("PERMISSION_DENIED ") for line in said), said
    assert all("is a process of uid 65534" in line for line in said), said
    assert pool_counts(stack.daemon_address).cached_pages >= cached  # nothing flushed


def smg_stored_blocks(metrics_url: str) -> float:
    """The blocks SMG has applied from its nodes' stored KV events."""
    scrape = Scrape(metrics_url)
    return sum(v for (name, labels), v in scrape.samples.items()
               if name == "smg_kv_event_blocks_total" and ("op", "stored") in labels)  # fmt: skip


def test_up_gateway_gets_the_nodes_events_while_the_public_port_wants_a_token(tmp_path: Path) -> None:
    """`up --gateway` wires SMG to the gateway listener, which needs no token, so the public port may
    require one (it could not before: SMG presents none); SMG serves the model by the stack's --model-id."""
    token = tmp_path / "token"
    token.write_text("the-clients-token\n")
    token.chmod(0o600)
    port = free_port()
    stack = start_stack(
        tmp_path,
        *("--gateway", str(port), "--api-token-file", str(token), "--kv-memory", "256MiB"),
        *("--model-id", "house-model"),
    )
    try:
        gateway = stack.endpoints()["gateway"]
        request = pb.GenerateRequest(prompt_token_ids=THEIR_PROMPT, sampling=pb.SamplingParams(max_tokens=1))
        with grpc.insecure_channel(stack.address) as channel:
            ours = generation_pb2_grpc.GenerationStub(channel)
            assert refused(lambda: ours.Complete(request)).code() == grpc.StatusCode.UNAUTHENTICATED
            ours.Complete(request, metadata=(("authorization", "Bearer the-clients-token"),))
        full_pages = len(THEIR_PROMPT) // 16
        wait_until(lambda: smg_stored_blocks(gateway["metrics"]) >= full_pages, 60, "SMG to apply the events")
        client = openai.OpenAI(base_url=gateway["address"], api_key="unused", max_retries=0, timeout=120)
        assert [model.id for model in client.models.list().data] == ["house-model"]
        reply = client.completions.create(model="house-model", prompt="The capital of", max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens == 2
    finally:
        assert stack.stop() == 0, stack.log()
