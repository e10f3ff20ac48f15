"""A request whose max_tokens is past the context's room, as a client sees it on a real stack: it goes to the
worker as asked, and generation ends with LENGTH at the context's end, under min_tokens too, for every
sample, and on SMG's vLLM protocol alike. A small random model keeps prompts that fill it fast: its worker
serves a context of 512 (--max-model-len), where its config.json gives 10**12 positions, whose rotary
table no machine holds.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.models import make_model
from tests.procs import Stack, start_stack

CONTEXT = 512  # the stack's --max-model-len
TOKEN = 5  # any ordinary token id, for prompts of an exact length


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    run_dir = Path(tempfile.mkdtemp(prefix="ps-"))
    model = make_model("llama", run_dir / "model", max_position_embeddings=10**12)
    flags = ("--model", str(model), "--kv-memory", "64MiB", "--max-model-len", str(CONTEXT))
    running = start_stack(run_dir, *flags)
    yield running
    assert running.stop() == 0, running.log()
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def channel(stack: Stack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack.address) as opened:
        yield opened


def last_responses(channel: grpc.Channel, request: pb.GenerateRequest) -> dict[int, pb.GenerateResponse]:
    """Each sample's last response, and the tokens it streamed in its usage."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    last, tokens = {}, {}
    for response in stub.Generate(request, timeout=60):
        tokens[response.index] = tokens.get(response.index, 0) + len(response.token_ids)
        last[response.index] = response
    assert all(last[index].usage.completion_tokens == tokens[index] for index in last)
    return last


@pytest.mark.parametrize(
    ("prompt_len", "sampling", "room"),
    [
        (CONTEXT - 2, {"max_tokens": 100}, 2),
        (CONTEXT - 1, {"max_tokens": 100}, 1),
        (CONTEXT - 2, {"max_tokens": 100, "min_tokens": 50}, 2),  # min_tokens past the context too
        (CONTEXT - 12, {}, 12),  # the frontend's default max_tokens (256)
        (CONTEXT - 3, {"max_tokens": 100, "n": 2, "seed": 7}, 3),
    ],
)
def test_generation_ends_with_length_at_the_contexts_end(
    channel: grpc.Channel, prompt_len: int, sampling: dict[str, int], room: int
) -> None:
    request = generate_request(token_ids=[TOKEN] * prompt_len, ignore_eos=True, **sampling)
    last = last_responses(channel, request)
    assert len(last) == sampling.get("n", 1)
    for response in last.values():
        assert response.finish_reason == pb.GenerateResponse.LENGTH
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_len, room)


def test_the_vllm_protocol_ends_with_length_at_the_contexts_end(channel: grpc.Channel) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    request = vllm_engine_pb2.GenerateRequest(
        request_id="full",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[TOKEN] * (CONTEXT - 2)),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=100, ignore_eos=True),
    )
    (reply,) = stub.Generate(request, timeout=60)
    assert (reply.complete.finish_reason, len(reply.complete.output_ids)) == ("length", 2)


def test_a_prompt_that_fills_the_context_is_refused_naming_it(channel: grpc.Channel) -> None:
    stub = generation_pb2_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(generate_request(token_ids=[TOKEN] * CONTEXT), timeout=60))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"the prompt has {CONTEXT} tokens, but the model's context is {CONTEXT} tokens" in (
        refused.value.details()
    )
