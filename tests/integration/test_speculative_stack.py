"""A real stack on the default model with `--speculative ngram`: a request that copies a passage gets the
tokens a request with speculation turned off (`sampling.speculative = false`) gets on the same worker, greedy
and seeded, with the same log-probabilities, in fewer engine steps; a stop string inside a drafted run of
tokens ends the text and the tokens where speculation-off ends them; the worker's metrics count the drafts,
and every page is back at the end. Bad speculation flags stop the worker before it loads anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.clients import Scrape, wait_for_every_page
from tests.integration.streams import joined, stream, user, wait_for_idle_worker
from tests.procs import REPO, Stack, module_stack

Reason = pb.GenerateResponse.FinishReason
Stub = generation_pb2_grpc.GenerationStub
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass lantern and a "
    "notebook in which he recorded the weather, the ships that passed, and the birds that rested on the "
    "railing. In winter the wind howled through the cracks in the old stone walls."
)
COPY = user("Repeat the following passage exactly, word for word:\n\n" + PASSAGE)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack(
        "--kv-memory", "256MiB", "--speculative", "ngram", "--num-speculative-tokens", "5"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[Stub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def worker_metrics(stack: Stack) -> Scrape:
    return Scrape(stack.metrics_url("worker"))


def steps_and_drafts(stack: Stack) -> tuple[float, float, float, float]:
    scrape = worker_metrics(stack)
    return (
        scrape("pagedserve_worker_engine_steps_total"),
        scrape("pagedserve_worker_spec_drafts_total"),
        scrape("pagedserve_worker_spec_draft_tokens_total"),
        scrape("pagedserve_worker_spec_accepted_tokens_total"),
    )


def run(
    stack: Stack, stub: Stub, messages: list[dict[str, str]] = COPY, **sampling: Any
) -> tuple[list[pb.GenerateResponse], tuple[float, ...]]:
    """One request alone; its responses, and what it added to the worker's step and draft counters."""
    before = steps_and_drafts(stack)
    responses = stream(stub, generate_request(messages=messages, **sampling), timeout=120)
    wait_for_idle_worker(stack)
    after = steps_and_drafts(stack)
    return responses, tuple(b - a for a, b in zip(before, after, strict=True))


SAMPLINGS = pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0, "logprobs": 2}, {"temperature": 0.8, "top_p": 0.95, "seed": 42}],
    ids=["greedy-logprobs", "seeded"],
)


def off_and_on(
    stack: Stack, stub: Stub, max_tokens: int, sampling: dict[str, Any], drafts_kept: bool = True
) -> tuple[float, ...]:
    """The copying request with speculation off, then on: the same tokens, log-probabilities and usage, and
    a step fewer for each kept draft token (some kept, if drafts_kept); (steps off, steps on, drafts, draft
    tokens, kept tokens)."""
    off, (off_steps, off_drafts, _, _) = run(
        stack, stub, max_tokens=max_tokens, speculative=False, **sampling
    )
    on, (on_steps, drafts, draft_tokens, accepted) = run(stack, stub, max_tokens=max_tokens, **sampling)
    assert joined(on) == joined(off)
    assert off_drafts == 0 and accepted <= draft_tokens
    assert not drafts_kept or (drafts > 0 and accepted > 0)
    assert on_steps + accepted == off_steps  # each kept draft token is a step saved
    if "logprobs" in sampling:
        on_logprobs = [(lp.token_id, lp.logprob) for r in on for lp in r.logprobs]
        off_logprobs = [(lp.token_id, lp.logprob) for r in off for lp in r.logprobs]
        assert [t for t, _ in on_logprobs] == [t for t, _ in off_logprobs] == joined(on)[1]
        assert [v for _, v in on_logprobs] == pytest.approx([v for _, v in off_logprobs], abs=1e-4)
    assert on[-1].usage.completion_tokens == off[-1].usage.completion_tokens == len(joined(on)[1])
    wait_for_every_page(stack.daemon_address)
    return off_steps, on_steps, drafts, draft_tokens, accepted


@SAMPLINGS
def test_a_copying_request_gets_speculation_offs_tokens_in_fewer_steps(
    stack: Stack, stub: Stub, sampling: dict[str, Any]
) -> None:
    off_steps, on_steps, *_ = off_and_on(stack, stub, 80, sampling)
    assert on_steps < 0.7 * off_steps


RECORD = {"name": "Ada Lovelace", "born": 1815, "city": "London", "field": "mathematics"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "city": {"type": "string"},
        "field": {"type": "string"},
    },
    "required": ["name", "born", "city", "field"],
}


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0, "structured": pb.StructuredOutput(json_schema=json.dumps(SCHEMA))},
        {"temperature": 0.5, "seed": 7, "frequency_penalty": 0.3, "presence_penalty": 0.2},
    ],
    ids=["json-schema", "seeded-penalized"],
)
def test_grammars_and_penalties_see_each_drafted_position(
    stack: Stack, stub: Stub, sampling: dict[str, Any]
) -> None:
    """A structured output's grammar masks each drafted row after the draft's tokens before it, and
    penalties count those tokens as output: the output is speculation-off's, with drafts kept."""
    messages = user("Repeat this JSON exactly:\n" + json.dumps(RECORD))
    off, _ = run(stack, stub, messages, max_tokens=60, speculative=False, **sampling)
    on, (_, drafts, _, accepted) = run(stack, stub, messages, max_tokens=60, **sampling)
    assert joined(on) == joined(off)
    assert drafts > 0 and accepted > 0
    if "structured" in sampling:
        assert json.loads(joined(on)[0]).keys() == RECORD.keys()
    wait_for_every_page(stack.daemon_address)


def test_a_stop_string_inside_a_drafted_run_ends_text_and_tokens_where_speculation_off_does(
    stack: Stack, stub: Stub
) -> None:
    stop = {"temperature": 0.0, "max_tokens": 80, "stop": ["ships that"], "logprobs": 1}
    off, _ = run(stack, stub, speculative=False, **stop)
    on, (_, drafts, _, accepted) = run(stack, stub, **stop)
    text, tokens = joined(on)
    assert (text, tokens) == joined(off)
    # The log-probabilities end with the tokens: none for the drafted tokens after the stop string.
    assert [lp.token_id for r in on for lp in r.logprobs] == tokens
    assert text.endswith("the ") and "ships" not in text and PASSAGE.startswith(text.strip()[:40])
    assert on[-1].finish_reason == Reason.STOP and on[-1].matched_stop_str == "ships that"
    assert on[-1].usage.completion_tokens == off[-1].usage.completion_tokens == len(tokens)
    # Every draft was kept whole (6 tokens a step), so the last response, shorter, was cut at the stop.
    assert drafts > 0 and accepted == 5 * drafts and len(on[-1].token_ids) < 6
    wait_for_every_page(stack.daemon_address)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--speculative", "eagle"], "invalid choice: 'eagle'"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "must be between 1 and 16, got 0"),
        (["--speculative", "ngram", "--num-speculative-tokens", "17"], "must be between 1 and 16, got 17"),
    ],
)
def test_bad_speculation_flags_stop_the_worker_with_a_message(flags: list[str], says: str) -> None:
    command = [sys.executable, "-m", "services.cli", "worker", *flags]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr, done.stderr
