"""The whole stack as a user runs it: `pagedserve up` on a free port, reached with the generated stubs."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from services.common.default_model import default_model_dir
from tests.integration.streams import (
    cancel_mid_stream,
    frontend_cpu_seconds,
    grpcurl,
    joined,
    pagedserve,
    stream,
    user,
    wait_for_idle_worker,
)
from tests.procs import Stack, module_stack

Reason = pb.GenerateResponse.FinishReason
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--kv-memory", "256MiB") as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_dir())


def test_streaming_and_unary_results_are_equal(stub: generation_pb2_grpc.GenerationStub) -> None:
    request = generate_request(messages=user("Name three colors."), max_tokens=40, **GREEDY)
    responses = stream(stub, request)
    text, token_ids = joined(responses)
    whole = stub.Complete(request)
    assert (whole.text, list(whole.token_ids)) == (text, token_ids)
    assert whole.finish_reason == responses[-1].finish_reason != Reason.FINISH_REASON_UNSPECIFIED
    first, second = responses[-1].usage, whole.usage
    assert (second.prompt_tokens, second.completion_tokens) == (first.prompt_tokens, first.completion_tokens)
    assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (
        0,
        (first.prompt_tokens - 1) // 16 * 16,
    )
    assert whole.usage.completion_tokens == len(token_ids) > 1
    assert not any(r.HasField("usage") for r in responses[:-1])


def test_stop_strings_end_the_text_and_are_never_emitted(stub: generation_pb2_grpc.GenerationStub) -> None:
    base = generate_request(prompt="Once upon a time", max_tokens=40, ignore_eos=True, **GREEDY)
    free_text = stub.Complete(base).text
    stop = free_text[20:26]  # a string the model will write, probably across tokens
    stopped = stream(
        stub, generate_request(prompt="Once upon a time", max_tokens=40, stop=["zzz", stop], **GREEDY)
    )
    text, _ = joined(stopped)
    assert text == free_text[: free_text.index(stop)]
    assert stop not in text
    assert stopped[-1].finish_reason == Reason.STOP


def test_multibyte_characters_split_across_tokens_come_out_whole(
    stub: generation_pb2_grpc.GenerationStub, tokenizer: PreTrainedTokenizerBase
) -> None:
    request = generate_request(
        messages=user("Translate 'hello world' into Chinese."), max_tokens=12, **GREEDY
    )
    responses = stream(stub, request)
    text, token_ids = joined(responses)
    split = [t for t in token_ids if "\ufffd" in tokenizer.decode([t])]
    assert split, "the model's answer should hold a character split across tokens"
    assert all("\ufffd" not in r.text for r in responses)
    assert text == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_sixty_four_concurrent_streams(stub: generation_pb2_grpc.GenerationStub) -> None:
    def one(i: int) -> tuple[int, str, pb.Usage]:
        request = generate_request(
            prompt=f"Story number {i}:", max_tokens=16, ignore_eos=True, seed=i, temperature=0.8
        )
        responses = stream(stub, request)
        return i, joined(responses)[0], responses[-1].usage

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert len(results) == 64
    assert all(usage.completion_tokens == 16 for _, _, usage in results)
    assert len({text for _, text, _ in results}) > 32  # different seeds, different stories


def test_cancelling_mid_stream_returns_the_pages(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub
) -> None:
    cancel_mid_stream(stack, stub)


def test_a_passed_deadline_aborts_the_request(stack: Stack, stub: generation_pb2_grpc.GenerationStub) -> None:
    request = generate_request(
        messages=user("Count to one thousand."), max_tokens=2000, ignore_eos=True, **GREEDY
    )
    with pytest.raises(grpc.RpcError) as caught:
        stream(stub, request, timeout=1.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for_idle_worker(stack)


BAD_REQUESTS = [
    (pb.GenerateRequest(), INVALID, "the request has no input"),
    (pb.GenerateRequest(prompt="hi", prompt_token_ids=[1]), INVALID, "set exactly one input"),
    (pb.GenerateRequest(prompt_token_ids=[5, 49152]), INVALID,
     "prompt_token_ids holds 49152, which is not a token of this model (0..49151)"),
    (generate_request("hi", temperature=-0.5), INVALID, "sampling.temperature must be between"),
    (generate_request("hi", top_p=7.0), INVALID, "sampling.top_p must be in (0, 1]"),
    (generate_request("hi", max_tokens=-3), INVALID, "sampling.max_tokens must be between 1"),
    (generate_request("hi", max_tokens=10**9), INVALID, "sampling.max_tokens"),
    (generate_request("hi", logprobs=500), INVALID, "sampling.logprobs"),
    (generate_request("hi", presence_penalty=float("nan")), INVALID, "finite number"),
    (generate_request("hi", stop=[""]), INVALID, "sampling.stop[0] must be 1 to 256"),
    (generate_request("hi", stop_token_ids=[10**6]), INVALID, "sampling.stop_token_ids holds 1000000"),
    (generate_request(messages=[{"role": "wizard", "content": "hi"}]), INVALID,
     "messages[0].role is 'wizard'"),
    (pb.GenerateRequest(prompt_token_ids=[5] * 8200), EXHAUSTED,
     "the prompt has 8200 tokens, but the model's context is 8192 tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("request_", "code", "message"), BAD_REQUESTS)
def test_bad_input_gets_its_status_and_the_server_keeps_serving(
    stack: Stack,
    stub: generation_pb2_grpc.GenerationStub,
    request_: pb.GenerateRequest,
    code: grpc.StatusCode,
    message: str,
) -> None:
    for call in (lambda: stream(stub, request_), lambda: stub.Complete(request_)):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == code
        assert message in caught.value.details(), caught.value.details()
    assert stub.Complete(generate_request("Hello", max_tokens=2)).usage.completion_tokens == 2
    wait_for_idle_worker(stack)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub
) -> None:
    """Tokenizing megabytes would take seconds of CPU; the frontend refuses them by their length first."""
    huge = "word " * (3 * 2**20 // 5)  # 3 MiB: under the public port's 4 MiB cap, far past the context
    idle = frontend_cpu_seconds(stack)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Complete(generate_request(huge, max_tokens=1))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "but the model's context is 8192" in caught.value.details()
    # Tokenizing it took about 8 s of the frontend's CPU; receiving and parsing it takes a part of 0.3 s.
    assert frontend_cpu_seconds(stack) - idle < 0.3
    small = stub.Complete(generate_request("Hi", max_tokens=2, ignore_eos=True))
    assert small.usage.completion_tokens == 2


def test_tokenize_and_model_info(
    stub: generation_pb2_grpc.GenerationStub, tokenizer: PreTrainedTokenizerBase
) -> None:
    ids = stub.Tokenize(pb.TokenizeRequest(text="Hello world")).token_ids
    assert list(ids) == tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Tokenize(pb.TokenizeRequest())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id.startswith("SmolLM2-135M-Instruct-")
    assert (info.max_context_length, info.vocab_size, list(info.eos_token_ids)) == (8192, 49152, [2])
    assert (info.dtype, info.device, info.page_size) == ("float32", "cpu", 16)


def test_health_and_reflection(stack: Stack) -> None:
    with grpc.insecure_channel(stack.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pagedserve.v1.Generation"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_logprobs_carry_token_text(stub: generation_pb2_grpc.GenerationStub) -> None:
    responses = stream(stub, generate_request("The sky is", max_tokens=3, logprobs=2, **GREEDY))
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert len(logprobs) == 3
    for lp, token in zip(logprobs, [t for r in responses for t in r.token_ids], strict=True):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob and lp.top[0].text


def test_a_client_that_is_not_ours_lists_checks_and_streams(stack: Stack) -> None:
    listed = grpcurl(stack.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= set(listed.stdout.split())

    health = grpcurl(
        "-d", '{"service": "pagedserve.v1.Generation"}', stack.address, "grpc.health.v1.Health/Check"
    )
    assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}

    body = json.dumps({"prompt": "The capital of France is", "sampling": {"max_tokens": 6, "temperature": 0}})
    streamed = grpcurl("-d", body, stack.address, "pagedserve.v1.Generation/Generate")
    assert streamed.returncode == 0, streamed.stderr
    messages = [json.loads(chunk) for chunk in streamed.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert len(messages) > 1
    assert messages[-1]["usage"]["completion_tokens"] == len(
        [t for m in messages for t in m.get("token_ids", [])]
    )
    assert "".join(m.get("text", "") for m in messages).strip()

    refused = grpcurl(
        "-d", '{"sampling": {"max_tokens": 5}}', stack.address, "pagedserve.v1.Generation/Generate"
    )
    assert refused.returncode != 0 and "InvalidArgument" in refused.stderr and "no input" in refused.stderr


def test_the_generate_and_chat_commands(stack: Stack) -> None:
    # No --temperature: the default is greedy, as the README's first command relies on.
    done = pagedserve("generate", "--address", stack.address, "What is the capital of France?")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    questions = "What is the capital of France?\nAnd of Italy?\n/reset\nAnd of Italy?\n"
    chat = pagedserve(
        "chat", "--address", stack.address, "--temperature", "0", "--max-tokens", "24", stdin=questions
    )
    assert chat.returncode == 0, chat.stderr
    answers = [line for line in chat.stdout.split("you> ") if "model> " in line]
    assert len(answers) == 3 and "Paris" in answers[0]
    assert "Rome" in answers[1] and "Rome" not in answers[2]  # the history gives the context; /reset drops it
    refused = pagedserve("generate", "--address", stack.address, "--max-tokens", "-1", "hi")
    assert refused.returncode == 1 and "INVALID_ARGUMENT: sampling.max_tokens" in refused.stderr
