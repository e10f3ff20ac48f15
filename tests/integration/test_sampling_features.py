"""SamplingParams' n, logit_bias, min_tokens and prompt_logprobs on a real stack with the default model
(SmolLM2-135M-Instruct), checked against n=1 runs, unbiased runs, unconstrained runs and HF transformers; and
bad values of each refused by name while the server keeps serving and every page comes back."""

from __future__ import annotations

import math
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from services.common.default_model import default_model_dir
from tests.clients import Scrape, wait_for_every_page
from tests.integration.streams import joined, stream, user, wait_for_idle_worker, worker_load
from tests.procs import Stack, module_stack
from tests.waiting import wait_until

Reason = pb.GenerateResponse.FinishReason
Stub = generation_pb2_grpc.GenerationStub
GREEDY: dict[str, Any] = {"temperature": 0.0}
PAGE = 16
EOS = 2  # <|im_end|>
STORY = "The capital of France is"
FOUR = user("What is 2+2? Answer with just the number.")  # greedy: "2 + 2 = 4", then EOS
SKY = user("Answer with one word: what color is the sky?")  # greedy: "The sky is a ... blue.", then EOS
PARIS = "Paris is the capital and most populous city of France, with an estimated population of two million."


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--kv-memory", "256MiB") as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[Stub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def by_sample(responses: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    samples: dict[int, list[pb.GenerateResponse]] = defaultdict(list)
    for response in responses:
        samples[response.index].append(response)
    return dict(samples)


def samples_of(stub: Stub, n: int, **request: Any) -> dict[int, list[pb.GenerateResponse]]:
    """A request's n samples, each checked to end with exactly one final message that has its usage."""
    samples = by_sample(stream(stub, generate_request(n=n, **request), timeout=60))
    assert sorted(samples) == list(range(n))
    for index, responses in samples.items():
        assert [bool(r.finish_reason) for r in responses] == [False] * (len(responses) - 1) + [True], index
        assert responses[-1].usage.completion_tokens == len(joined(responses)[1]), index
    return samples


def tokenize(stub: Stub, text: str) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)


def pages_all_back(stack: Stack) -> None:
    wait_for_idle_worker(stack)
    wait_for_every_page(stack.daemon_address)


def test_greedy_samples_are_all_the_one_greedy_output(stack: Stack, stub: Stub) -> None:
    alone = stub.Complete(generate_request(prompt=STORY, max_tokens=12, ignore_eos=True, **GREEDY))
    url = stack.metrics_url("frontend")
    before = Scrape(url)("pagedserve_generation_tokens_total")
    samples = samples_of(stub, 3, prompt=STORY, max_tokens=12, ignore_eos=True, **GREEDY)
    for responses in samples.values():
        assert joined(responses) == (alone.text, list(alone.token_ids))
        assert responses[-1].finish_reason == Reason.LENGTH
    # The frontend counts every sample's tokens (once the call has ended, which the last message precedes).
    counted = lambda: Scrape(url)("pagedserve_generation_tokens_total") - before  # noqa: E731
    wait_until(lambda: counted() == 36, 10, lambda: f"36 tokens counted, not {counted()}")


@pytest.mark.parametrize("seed", [7, 2**63 - 2])  # near the top of int64, seed + i wraps round to the bottom
def test_seeded_sample_i_is_the_run_of_seed_plus_i(stack: Stack, stub: Stub, seed: int) -> None:
    request: dict[str, Any] = {"prompt": STORY, "max_tokens": 8, "ignore_eos": True, "temperature": 1.0}
    samples = samples_of(stub, 4, seed=seed, **request)
    outputs = [joined(samples[i])[1] for i in range(4)]
    assert len({tuple(output) for output in outputs}) > 1, "the samples did not get seeds of their own"
    for i, output in enumerate(outputs):
        alone = stub.Complete(generate_request(seed=(seed + i + 2**63) % 2**64 - 2**63, **request))
        assert output == list(alone.token_ids), i
    pages_all_back(stack)


@pytest.mark.parametrize("round_", range(4))  # the followers' cache hit must hold every time, not by luck
def test_later_samples_find_a_new_prompts_pages_in_the_prefix_cache(
    stack: Stack, stub: Stub, round_: int
) -> None:
    prompt = (
        f"[{uuid.uuid4().hex}] The history of the city begins with a small settlement on the river, where "
        "traders met every spring to exchange grain, wool and salt for tools."
    )
    size = len(tokenize(stub, prompt))
    assert 50 <= size <= 70 and size > 3 * PAGE
    samples = samples_of(stub, 4, prompt=prompt, max_tokens=4, **GREEDY)
    usage = [samples[i][-1].usage for i in range(4)]
    assert [u.prompt_tokens for u in usage] == [size] * 4
    assert [u.cached_prompt_tokens for u in usage] == [0] + [(size - 1) // PAGE * PAGE] * 3
    pages_all_back(stack)


def test_cancelling_a_stream_of_samples_returns_every_page(stack: Stack, stub: Stub) -> None:
    request = generate_request(prompt=STORY, n=4, max_tokens=2000, ignore_eos=True, temperature=1.0)
    call = stub.Generate(request)
    seen: set[int] = set()
    for response in call:
        seen.add(response.index)
        if seen == {0, 1, 2, 3}:
            break
    assert seen == {0, 1, 2, 3}
    assert worker_load(stack).kv_pages_in_use > 0  # the samples hold pages now
    call.cancel()
    pages_all_back(stack)


def test_a_positive_bias_forces_a_token_and_logprobs_stay_raw(stub: Stub) -> None:
    plain = stub.Complete(generate_request(prompt=STORY, max_tokens=5, ignore_eos=True, logprobs=5, **GREEDY))
    runner_up = plain.logprobs[0].top[1]  # the token greedy would take second
    biased = stub.Complete(
        generate_request(prompt=STORY, max_tokens=5, ignore_eos=True, logprobs=5,
                         logit_bias={runner_up.token_id: 100.0}, **GREEDY)
    )  # fmt: skip
    assert list(biased.token_ids) == [runner_up.token_id] * 5
    first = biased.logprobs[0]
    assert first.logprob == pytest.approx(runner_up.logprob, abs=1e-4)  # not ~0, as the biased logits give
    assert [t.token_id for t in first.top] == [t.token_id for t in plain.logprobs[0].top]
    assert all(lp.logprob < -0.01 for lp in biased.logprobs)


def test_a_negative_bias_on_the_greedy_token_takes_the_next_one(stub: Stub) -> None:
    plain = stub.Complete(generate_request(prompt=STORY, max_tokens=3, ignore_eos=True, logprobs=3, **GREEDY))
    best, runner_up = plain.logprobs[0].top[:2]
    assert best.token_id == plain.token_ids[0]
    biased = stub.Complete(
        generate_request(prompt=STORY, max_tokens=3, ignore_eos=True, logprobs=3,
                         logit_bias={best.token_id: -100.0}, **GREEDY)
    )  # fmt: skip
    assert biased.token_ids[0] == runner_up.token_id != best.token_id
    first = biased.logprobs[0]
    assert first.logprob == pytest.approx(runner_up.logprob, abs=1e-4)
    assert [(t.token_id, t.text) for t in first.top] == [(t.token_id, t.text) for t in plain.logprobs[0].top]


def test_min_tokens_holds_back_eos(stub: Stub) -> None:
    free = stub.Complete(generate_request(messages=FOUR, max_tokens=20, **GREEDY))
    assert free.finish_reason == Reason.STOP and free.token_ids[-1] == EOS and len(free.token_ids) < 12
    held = stub.Complete(generate_request(messages=FOUR, max_tokens=20, min_tokens=12, **GREEDY))
    assert len(held.token_ids) >= 12 and EOS not in held.token_ids[:12]
    assert list(held.token_ids[: len(free.token_ids) - 1]) == list(free.token_ids[:-1])  # the same until then


def test_min_tokens_looks_for_stop_strings_only_after_it(stub: Stub) -> None:
    free = stream(stub, generate_request(messages=SKY, max_tokens=30, stop=["."], **GREEDY))
    text, ids = joined(free)
    assert free[-1].finish_reason == Reason.STOP and free[-1].matched_stop_str == "." and len(ids) < 12
    held = stream(stub, generate_request(messages=SKY, max_tokens=30, stop=["."], min_tokens=12, **GREEDY))
    held_text, held_ids = joined(held)
    assert held_text.startswith(text + ".") and len(held_ids) >= 12
    assert held[-1].finish_reason == Reason.LENGTH or not held_text.endswith(".")


def test_a_stop_string_in_the_min_tokens_th_token_counts(stub: Stub) -> None:
    """min_tokens counts the token that brings the output to it: a stop string that the free run completes in
    its last token stops a run whose min_tokens is that many tokens, at the same place."""
    free = stream(stub, generate_request(messages=SKY, max_tokens=30, stop=["."], **GREEDY))
    text, ids = joined(free)
    assert free[-1].matched_stop_str == "." and 1 < len(ids) < 12
    request = generate_request(messages=SKY, max_tokens=30, stop=["."], min_tokens=len(ids), **GREEDY)
    exact = stream(stub, request)
    assert joined(exact) == (text, ids)
    assert exact[-1].finish_reason == Reason.STOP and exact[-1].matched_stop_str == "."


def test_min_tokens_holds_back_stop_token_ids(stub: Stub) -> None:
    (dot,) = tokenize(stub, ".")
    free = stub.Complete(generate_request(messages=SKY, max_tokens=30, stop_token_ids=[dot], **GREEDY))
    assert free.finish_reason == Reason.STOP and free.token_ids[-1] == dot and len(free.token_ids) < 12
    held = stub.Complete(
        generate_request(messages=SKY, max_tokens=30, stop_token_ids=[dot], min_tokens=12, **GREEDY)
    )
    assert len(held.token_ids) >= 12 and dot not in held.token_ids[:12]
    assert held.finish_reason == Reason.LENGTH or held.token_ids[-1] in (dot, EOS)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(stub: Stub) -> tuple[list[int], torch.Tensor]:
    """PARIS's token ids, and HF transformers' float32 log-softmax at each of its positions but the last."""
    prompt = tokenize(stub, PARIS)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return prompt, torch.log_softmax(logits, dim=-1)


def prompt_logprobs_of(responses: list[pb.GenerateResponse]) -> list[pb.TokenLogprobs]:
    """The prompt's log-probabilities, which come on the first message alone."""
    assert not any(r.prompt_logprobs for r in responses[1:])
    return list(responses[0].prompt_logprobs)


def test_prompt_logprobs_match_transformers(
    stub: Stub, hf_prompt_logprobs: tuple[list[int], torch.Tensor]
) -> None:
    prompt, reference = hf_prompt_logprobs
    assert 17 <= len(prompt) <= 24
    responses = stream(stub, generate_request(prompt=PARIS, max_tokens=2, prompt_logprobs=5, **GREEDY))
    scored = prompt_logprobs_of(responses)
    assert [entry.token_id for entry in scored] == prompt[1:]
    expected_top = reference.topk(5, dim=-1)
    for position, entry in enumerate(scored):
        row = reference[position]
        assert abs(entry.logprob - row[entry.token_id].item()) < 1e-3, position
        assert len(entry.top) == 5
        for rank, top in enumerate(entry.top):
            assert abs(top.logprob - expected_top.values[position, rank].item()) < 1e-3, (position, rank)
            # The same token, or one tied with it (within float error) in HF's logits.
            tied = abs(row[top.token_id].item() - expected_top.values[position, rank].item()) < 1e-3
            assert top.token_id == expected_top.indices[position, rank].item() or tied, (position, rank)
            assert top.text
    assert responses[-1].usage.cached_prompt_tokens == 0


def test_prompt_logprobs_are_computed_not_taken_from_the_prefix_cache(stub: Stub) -> None:
    prompt = f"[{uuid.uuid4().hex}] " + PARIS
    request = generate_request(prompt=prompt, max_tokens=2, prompt_logprobs=3, **GREEDY)
    first, second = stub.Complete(request), stub.Complete(request)
    size = first.usage.prompt_tokens
    assert first.usage.cached_prompt_tokens == second.usage.cached_prompt_tokens == 0
    assert len(first.prompt_logprobs) == len(second.prompt_logprobs) == size - 1
    for a, b in zip(first.prompt_logprobs, second.prompt_logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    # The prompt's pages were in the cache all along: a request without prompt_logprobs finds them.
    plain = stub.Complete(generate_request(prompt=prompt, max_tokens=2, **GREEDY))
    assert plain.usage.cached_prompt_tokens == (size - 1) // PAGE * PAGE > 0


def test_a_prompts_logprobs_come_once_with_its_first_sample(stub: Stub) -> None:
    """n samples share one prompt: its log-probabilities come once, on sample 0's first message, and the
    later samples, which do not score it, find its pages in the prefix cache."""
    prompt = f"[{uuid.uuid4().hex}] " + PARIS
    samples = samples_of(stub, 3, prompt=prompt, max_tokens=2, prompt_logprobs=2, **GREEDY)
    size = samples[0][-1].usage.prompt_tokens
    assert [entry.token_id for entry in prompt_logprobs_of(samples[0])] == tokenize(stub, prompt)[1:]
    assert not any(r.prompt_logprobs for index in (1, 2) for r in samples[index])
    cached = [samples[index][-1].usage.cached_prompt_tokens for index in range(3)]
    assert cached == [0] + [(size - 1) // PAGE * PAGE] * 2


def test_prompt_logprobs_zero_scores_the_prompt_without_top(stub: Stub) -> None:
    prompt = tokenize(stub, PARIS)
    scored = prompt_logprobs_of(stream(stub, generate_request(prompt=PARIS, max_tokens=2, prompt_logprobs=0)))
    assert [entry.token_id for entry in scored] == prompt[1:]
    assert all(not entry.top and entry.logprob < 0 for entry in scored)
    plain = stream(stub, generate_request(prompt=PARIS, max_tokens=2))
    assert not any(r.prompt_logprobs for r in plain)  # unset: none


BAD = {
    "n-17": ({"n": 17}, "sampling.n"),
    "bias-over-100": ({"logit_bias": {5: 100.5}}, "sampling.logit_bias[5]"),
    "bias-under-100": ({"logit_bias": {5: -101.0}}, "sampling.logit_bias[5]"),
    "bias-nan": ({"logit_bias": {5: math.nan}}, "sampling.logit_bias[5]"),
    "bias-not-a-token": (
        {"logit_bias": {49152: 1.0}},
        "sampling.logit_bias holds 49152, which is not a token of this model",
    ),
    "bias-301-tokens": ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "sampling.logit_bias"),
    "min-over-max": ({"min_tokens": 6, "max_tokens": 5}, "sampling.min_tokens"),
    "prompt-logprobs-21": ({"prompt_logprobs": 21}, "sampling.prompt_logprobs"),
}


@pytest.mark.parametrize("call", ["Generate", "Complete"])
@pytest.mark.parametrize(("sampling", "named"), BAD.values(), ids=BAD.keys())
def test_bad_values_are_refused_by_name_and_the_server_keeps_serving(
    stack: Stack, stub: Stub, call: str, sampling: dict[str, Any], named: str
) -> None:
    request = generate_request(prompt=STORY, **{"max_tokens": 5, **sampling})
    if call == "Complete" and "n" in sampling:
        named = "n > 1"  # Complete refuses any n > 1 before it checks the range
    with pytest.raises(grpc.RpcError) as refused:
        stub.Complete(request) if call == "Complete" else stream(stub, request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in refused.value.details()
    assert stub.Complete(generate_request(prompt=STORY, max_tokens=3, **GREEDY)).usage.completion_tokens == 3
    pages_all_back(stack)


def test_complete_refuses_more_than_one_sample(stack: Stack, stub: Stub) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Complete(generate_request(prompt=STORY, n=2, max_tokens=3))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n > 1" in refused.value.details() and "Generate" in refused.value.details()
    ok = stub.Complete(generate_request(prompt=STORY, n=1, max_tokens=3, **GREEDY))
    assert ok.usage.completion_tokens == 3
    pages_all_back(stack)
