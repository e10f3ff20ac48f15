"""One condition, one status and one message, wherever it is found: the same bad request sent to a real
frontend and straight to its worker's Connect stream is refused the same way by both."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from tests.integration.worker_stream import WorkerStream
from tests.procs import Stack, module_stack

VOCAB = 49152  # SmolLM2's
CONTEXT = 8192

# (prompt token ids, sampling): each is wrong in one way only.
BAD = {
    "a prompt token outside the vocabulary": ([5, VOCAB + 7], pb.SamplingParams(max_tokens=4)),
    "a stop token outside the vocabulary": ([5, 6], pb.SamplingParams(max_tokens=4, stop_token_ids=[VOCAB])),
    "a biased token outside the vocabulary": (
        [5, 6],
        pb.SamplingParams(max_tokens=4, logit_bias={VOCAB: 1.0}),
    ),
    "a prompt over the context": ([5] * (CONTEXT + 3), pb.SamplingParams(max_tokens=4)),
    "a prompt that leaves no room": ([5] * CONTEXT, pb.SamplingParams(max_tokens=4)),
    "a temperature out of range": ([5, 6], pb.SamplingParams(max_tokens=4, temperature=-1.0)),
    # Past float32's range once it divides a logit: every logit inf, and token 0 streamed as if all were well.
    "a repetition penalty below its floor": (
        [5, 6],
        pb.SamplingParams(max_tokens=4, repetition_penalty=1e-39),
    ),
}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack() as running:
        yield running


def frontend_refusal(stack: Stack, prompt: list[int], sampling: pb.SamplingParams) -> tuple[int, str]:
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=60))
    return refused.value.code().value[0], refused.value.details()


def worker_refusal(stack: Stack, prompt: list[int], sampling: pb.SamplingParams) -> tuple[int, str]:
    stream = WorkerStream(stack.worker_address(0))
    try:
        stream.submit("bad", prompt, sampling)
        (output,) = stream.collect({"bad"})["bad"]
    finally:
        stream.close()
    assert output.finish_reason == pb.GenerateResponse.FinishReason.ABORT and not output.token_ids
    return output.error_code, output.error


@pytest.mark.parametrize("case", BAD)
def test_a_frontend_and_a_worker_refuse_a_bad_request_alike(stack: Stack, case: str) -> None:
    prompt, sampling = BAD[case]
    code, message = frontend_refusal(stack, prompt, sampling)
    assert code in (grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    assert message, "a refusal says why"
    assert worker_refusal(stack, prompt, sampling) == (code, message)
