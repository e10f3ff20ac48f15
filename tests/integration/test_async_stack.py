"""A real stack with async scheduling on (`--async-scheduling on`; auto turns it on for CUDA only): the
worker launches each step before the tokens of the one before are on the host. Concurrent greedy streams
agree token for token with HF transformers, a stop token ends a stream whose next step was already
launched, seeded draws do not depend on the batch, and cancelled or finished requests give every page back.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from services.common.default_model import default_model_dir
from tests.integration.streams import cancel_mid_stream, joined, stream, user, wait_for_idle_worker
from tests.procs import Stack, module_stack

Reason = pb.GenerateResponse.FinishReason
Stub = generation_pb2_grpc.GenerationStub
GREEDY: dict[str, Any] = {"temperature": 0.0}
EOS = 2  # <|im_end|>
PROMPTS = [f"Story number {i}: once upon a time" for i in range(6)]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--kv-memory", "256MiB", "--async-scheduling", "on") as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[Stub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def hf() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


def hf_greedy(hf: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def concurrently(stub: Stub, requests: list[pb.GenerateRequest]) -> list[list[pb.GenerateResponse]]:
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: stream(stub, request, timeout=120), requests))


def test_concurrent_greedy_streams_match_transformers(stack: Stack, stub: Stub, hf: PreTrainedModel) -> None:
    requests = [generate_request(prompt=p, max_tokens=24, ignore_eos=True, **GREEDY) for p in PROMPTS]
    for prompt, responses in zip(PROMPTS, concurrently(stub, requests), strict=True):
        ids = list(stub.Tokenize(pb.TokenizeRequest(text=prompt)).token_ids)
        assert joined(responses)[1] == hf_greedy(hf, ids, 24), prompt
        assert responses[-1].finish_reason == Reason.LENGTH
    wait_for_idle_worker(stack)


def test_eos_ends_streams_launched_a_step_ahead(stack: Stack, stub: Stub, hf: PreTrainedModel) -> None:
    questions = [f"What is {n}+{n}? Answer with just the number." for n in (1, 2, 3, 4)]
    requests = [generate_request(messages=user(q), max_tokens=40, **GREEDY) for q in questions]
    for responses in concurrently(stub, requests):
        ids = joined(responses)[1]
        assert responses[-1].finish_reason == Reason.STOP and ids[-1] == EOS and EOS not in ids[:-1]
    alone = stub.Complete(requests[0])
    assert list(alone.token_ids) == joined(concurrently(stub, requests[:1])[0])[1]
    wait_for_idle_worker(stack)


def test_a_seeded_draw_does_not_depend_on_the_batch(stack: Stack, stub: Stub) -> None:
    seeded = generate_request(prompt=PROMPTS[0], max_tokens=20, ignore_eos=True, temperature=0.9, seed=7)
    alone = joined(stream(stub, seeded))[1]
    others = [
        generate_request(prompt=p, max_tokens=30, ignore_eos=True, temperature=0.9) for p in PROMPTS[1:]
    ]
    in_batch = concurrently(stub, [seeded, *others])[0]
    assert joined(in_batch)[1] == alone
    wait_for_idle_worker(stack)


def test_cancelling_mid_stream_returns_the_pages(stack: Stack, stub: Stub) -> None:
    cancel_mid_stream(stack, stub, messages=5)  # with a step in flight: its pages wait for it
