"""Two real stacks behind SMG's gateway (`pagedserve gateway`, the pinned `smg` binary), called with the
OpenAI SDK: chat and completions as pagedserve answers them itself, streamed or not; stop strings, n samples
and logprobs; a client that goes away mid-stream; bad requests; the bench, straight and through the gateway;
routing by the daemons' KV events, which a worker restart does not clear; and a stack that is killed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.common.default_model import default_model_dir
from tests.clients import Scrape, wait_for_every_page
from tests.integration.gateway import Gateway
from tests.integration.streams import wait_for_idle_worker
from tests.procs import REPO, Stack, free_port, start_stack
from tests.waiting import wait_until

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Long shared prefixes: a system prompt of many full pages, different for each routing test.
PREFIX_B = "You are a careful assistant for a library. " * 40
PREFIX_A = "You answer questions about the weather in short sentences. " * 30
BYSTANDER_TOKENS = 100


@pytest.fixture(scope="module")
def stacks() -> Iterator[list[Stack]]:
    """Two stacks; the last test kills the first, so only the second must stop cleanly."""
    default_model_dir()  # convert once before the processes race for it
    folders = [Path(tempfile.mkdtemp(prefix="ps-")) for _ in range(2)]
    running = [
        start_stack(folder, "--kv-memory", "512MiB", "--gateway-address", f"127.0.0.1:{free_port()}")
        for folder in folders
    ]
    yield running
    for stack in running:
        stack.proc.poll() is None and stack.stop()
    assert running[1].proc.returncode == 0, running[1].log()
    assert not any(stack.survivors() for stack in running), "a stack left processes behind"
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def gateway(stacks: list[Stack], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    running = Gateway(stacks, tmp_path_factory.mktemp("gateway") / "smg.log")
    yield running
    assert running.stop() == 0, running.log_path.read_text(errors="replace")


def own(stack: Stack, request: pb.GenerateRequest) -> pb.GenerateResponse:
    """pagedserve's own answer, over its own gRPC API."""
    with grpc.insecure_channel(stack.address) as channel:
        return generation_pb2_grpc.GenerationStub(channel).Complete(request)


def messages(pairs: list[dict[str, str]]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in pairs]


def test_chat_streamed_or_not_is_pagedserves_own_answer(stacks: list[Stack], gateway: Gateway) -> None:
    sampling = pb.SamplingParams(max_tokens=24, temperature=0)
    expected = own(stacks[0], pb.GenerateRequest(messages=messages(QUESTION), sampling=sampling))
    whole = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,  # type: ignore[arg-type]
    )
    assert whole.choices[0].message.content == expected.text
    assert whole.usage is not None and whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
    streamed = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert next(c for c in chunks if c.choices and c.choices[0].finish_reason).choices[0].finish_reason == (
        whole.choices[0].finish_reason
    )
    # A stream's usage too: SMG takes the prompt's count from the stream's last message.
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == len(expected.token_ids)
    assert usage.prompt_tokens == expected.usage.prompt_tokens


def test_completions_stop_at_a_stop_string(stacks: list[Stack], gateway: Gateway) -> None:
    prompt = "Count: 1, 2, 3,"
    sampling = pb.SamplingParams(max_tokens=30, temperature=0, stop=[" 6"])
    expected = own(stacks[0], pb.GenerateRequest(prompt=prompt, sampling=sampling))
    for stream in (False, True):
        reply = gateway.client.completions.create(
            model=gateway.model, prompt=prompt, max_tokens=30, temperature=0, stop=[" 6"], stream=stream
        )
        parts = list(reply) if stream else [reply]
        assert "".join(p.choices[0].text for p in parts if p.choices) == expected.text == " 4, 5,"
        assert parts[-1].choices[0].finish_reason == "stop"


def test_n_samples_and_logprobs(stacks: list[Stack], gateway: Gateway) -> None:
    several = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=QUESTION,
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=5,  # type: ignore[arg-type]
    )
    assert sorted(choice.index for choice in several.choices) == [0, 1, 2]
    assert all(choice.message.content for choice in several.choices)
    # Three draws, not one answer three times (seeded, so the same on every run).
    assert len({choice.message.content for choice in several.choices}) > 1, several.choices
    # The seed reaches the worker: a seeded draw is pagedserve's own draw with that seed.
    sampling = pb.SamplingParams(max_tokens=16, temperature=1.0, seed=5)
    expected = own(stacks[0], pb.GenerateRequest(messages=messages(QUESTION), sampling=sampling))
    seeded = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=QUESTION,
        max_tokens=16,
        temperature=1.0,
        seed=5,  # type: ignore[arg-type]
    )
    assert seeded.choices[0].message.content == expected.text
    streamed = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=QUESTION,
        max_tokens=8,
        n=2,
        stream=True,  # type: ignore[arg-type]
    )
    finished = {c.choices[0].index for c in streamed if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    sampling = pb.SamplingParams(max_tokens=5, temperature=0, logprobs=3)
    expected = own(stacks[0], pb.GenerateRequest(messages=messages(QUESTION), sampling=sampling))
    with_logprobs = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = with_logprobs.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and all(len(entry.top_logprobs) == 3 for entry in content)
    assert [entry.logprob for entry in content] == pytest.approx(
        [lp.logprob for lp in expected.logprobs], abs=1e-3
    )


def test_structured_outputs_through_the_gateway(gateway: Gateway) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "people": {"type": "integer"}},
        "required": ["city", "people"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    reply = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=QUESTION,
        max_tokens=60,
        temperature=0,
        response_format=response_format,  # type: ignore[arg-type]
    )
    answer = json.loads(reply.choices[0].message.content or "")
    assert set(answer) == {"city", "people"} and isinstance(answer["people"], int)
    assert reply.choices[0].finish_reason == "stop"


def bystander(channel: grpc.Channel, request_id: str) -> Iterator[vllm_engine_pb2.GenerateResponse]:
    """A stream of BYSTANDER_TOKENS tokens on a stack's gateway listener, as another gateway's request; its
    first chunk is read, so it is running."""
    sampling = vllm_engine_pb2.SamplingParams(max_tokens=BYSTANDER_TOKENS, ignore_eos=True, temperature=0)
    request = vllm_engine_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[32, 9485, 1743, 42]),
        sampling_params=sampling,
        stream=True,
    )
    call = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request)
    assert next(call).chunk.token_ids
    return call


def test_a_client_that_goes_away_mid_stream_gets_its_pages_freed(
    stacks: list[Stack], gateway: Gateway
) -> None:
    # A request runs beside it on each stack: the gateway's Abort ends the one that went away, by its id, and
    # no other (on its stack the bystander shares its batch, so it is far from done when the abort comes).
    channels = [grpc.insecure_channel(stack.gateway_address) for stack in stacks]
    others = [bystander(channel, f"bystander-{i}") for i, channel in enumerate(channels)]
    stream = gateway.client.completions.create(
        model=gateway.model,
        prompt="Tell me a very long story.",
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    for call in others:
        ends = [message.complete for message in call if message.HasField("complete")]
        assert [(end.finish_reason, end.completion_tokens) for end in ends] == [("length", BYSTANDER_TOKENS)]
    for channel in channels:
        channel.close()
    for stack in stacks:
        wait_for_idle_worker(stack, timeout_s=15)
        wait_for_every_page(stack.daemon_address)


def test_bad_requests_get_4xx_with_a_message_and_every_page_stays_accounted(
    stacks: list[Stack], gateway: Gateway
) -> None:
    create = gateway.client.chat.completions.create
    bad = [
        (dict(temperature=-1), openai.BadRequestError, "temperature"),
        (dict(top_p=1.5), openai.BadRequestError, "top_p"),
        (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
        (dict(model="no-such-model"), openai.NotFoundError, "no-such-model"),
        (
            dict(messages=[{"role": "user", "content": "word " * 9000}]),
            openai.BadRequestError,
            "context length",
        ),
    ]
    for change, error, words in bad:
        request = {"model": gateway.model, "messages": QUESTION, "max_tokens": 4, **change}
        with pytest.raises(error) as refused:
            create(**request)  # type: ignore[call-overload]
        assert words in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:  # a regex that cannot compile, in our words
        create(model=gateway.model, messages=QUESTION, max_tokens=4, extra_body={"regex": "("})
    assert "does not compile" in str(refused.value)
    for stack in stacks:
        wait_for_idle_worker(stack)
        wait_for_every_page(stack.daemon_address)


def test_the_bench_sends_a_stack_and_the_gateway_the_same_tokens(
    stacks: list[Stack], gateway: Gateway, tmp_path: Path
) -> None:
    """The gateway's cost, measured as the README shows it: text prompts that SMG tokenizes back into the
    bench's ids (other prompt token counts would be errors in the run), each run on a flushed cache."""
    command = [sys.executable, "-m", "services.cli", "bench", "--target", f"direct={stacks[0].address}",
               "--target", f"smg={gateway.url}", "--prompts", "text", "--requests", "4", "--concurrency", "2",
               "--input-len", "40-80", "--output-len", "4-8", "--out", str(tmp_path),
               "--endpoints", str(stacks[0].run_dir / "endpoints.json")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    direct, through = json.loads((tmp_path / "bench.json").read_text())["runs"]
    for run in (direct, through):
        assert run["summary"]["completed"] == 4 and run["summary"]["errors"] == {}, run
        assert run["summary"]["cached_prompt_tokens"] == 0  # the direct run's prompts were flushed
    assert direct["summary"]["output_tokens"] == through["summary"]["output_tokens"]  # exact lengths
    assert "prefix cache: dropped" in done.stderr


def prompt_tokens(stack: Stack) -> tuple[float, float]:
    """The stack's worker's (prompt tokens, of which from the prefix cache), as it counts them."""
    scrape = Scrape(stack.metrics_url("worker"))
    return scrape("pagedserve_worker_prompt_tokens_total"), scrape(
        "pagedserve_worker_cached_prompt_tokens_total"
    )


def ask_with_prefix(gateway: Gateway, prefix: str, question: str) -> int:
    """One chat through the gateway; returns its cached prompt tokens."""
    reply = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "system", "content": prefix}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_requests_land_on_the_stack_whose_daemon_holds_their_prefix(
    stacks: list[Stack], gateway: Gateway
) -> None:
    """Each prefix is computed on one stack directly, bypassing the gateway: only that daemon's KV events
    can tell the gateway where it is."""
    for holder, prefix in ((stacks[1], PREFIX_B), (stacks[0], PREFIX_A)):
        warm = [{"role": "system", "content": prefix}, {"role": "user", "content": "Hello"}]
        known = gateway.stored_blocks(holder)
        own(holder, pb.GenerateRequest(messages=messages(warm), sampling=pb.SamplingParams(max_tokens=1)))
        # The 16 pages (256 tokens) that each request below must find cached, as SMG applied them.
        applied = lambda h=holder, k=known: gateway.stored_blocks(h) >= k + 16  # noqa: E731
        wait_until(applied, 30, "the events to reach SMG")
        before = [prompt_tokens(stack) for stack in stacks]
        cached = [ask_with_prefix(gateway, prefix, f"Question {i}: name a colour.") for i in range(4)]
        after = [prompt_tokens(stack) for stack in stacks]
        assert all(c >= 256 for c in cached), cached
        other = stacks[0] if holder is stacks[1] else stacks[1]
        assert after[stacks.index(other)] == before[stacks.index(other)]  # nothing went to the other stack
        gained = after[stacks.index(holder)][1] - before[stacks.index(holder)][1]
        assert gained == sum(cached)  # the holder's prefix cache served every one


def test_a_worker_restart_keeps_the_nodes_events(stacks: list[Stack], gateway: Gateway) -> None:
    holder = stacks[1]
    os.kill(holder.pid("worker"), signal.SIGKILL)
    wait_until(lambda: "worker-0 is back" in holder.log(), 120, "the stack to start its worker again")
    # Its frontend said it was unhealthy while the worker was away: the gateway may have noticed.
    wait_until(lambda: gateway.ready_workers() == 2, 30, gateway.describe)
    before = prompt_tokens(holder)
    cached = ask_with_prefix(gateway, PREFIX_B, "Question 9: name a fruit.")
    after = prompt_tokens(holder)
    assert after[0] > before[0], "the gateway sent the request to the other stack"
    assert cached >= 256 and after[1] - before[1] >= 256, (cached, before, after)  # served from its daemon


def test_the_gateway_routes_around_a_killed_stack(stacks: list[Stack], gateway: Gateway) -> None:
    dead = stacks[0]
    for line in dead.survivors():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    dead.proc.kill()
    survivor = stacks[1].metrics_url("frontend")
    before, started = Scrape(survivor)("pagedserve_requests_total", code="OK"), time.monotonic()
    for i in range(6):
        ask_with_prefix(gateway, PREFIX_A, f"Question {i}: name a city.")  # A's prefix: A's stack is gone
    assert time.monotonic() - started < 60
    assert Scrape(survivor)("pagedserve_requests_total", code="OK") - before == 6
