"""Structured outputs on a real stack with the default model: greedy and sampled outputs always match their
JSON schema, JSON object, regex, grammar or choice, batched with free requests that they leave untouched; a
finished grammar ends the request even under ignore_eos; bad constraints are refused and a dead end fails
the request without losing a page. In process: the worker's grammar cache, and choices that need escaping."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from transformers import PreTrainedTokenizerFast as Tokenizer

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.common.default_model import default_model_dir
from services.common.structured import Constraint
from services.worker.core.grammar import Grammars, fill_masks, mask_logits
from services.worker.models.registry import load_spec
from tests.clients import wait_for_every_page
from tests.integration.streams import wait_for_idle_worker
from tests.procs import Stack, module_stack

STOP, LENGTH = pb.GenerateResponse.STOP, pb.GenerateResponse.LENGTH
COLORS = ["red", "green", "blue"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": COLORS},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
REGEX = "[A-Z][a-z]{2,8} [0-9]{1,3}"
GRAMMAR = 'root ::= "The answer is " num "."\nnum ::= [0-9] | [1-9] [0-9]'
GRAMMAR_AS_REGEX = r"The answer is ([0-9]|[1-9][0-9])\."


def choice(*choices: str) -> pb.StructuredOutput:
    return pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=choices))


@dataclass(frozen=True)
class Case:
    question: str
    structured: pb.StructuredOutput | None = None
    temperature: float = 0.0
    seed: int | None = None
    max_tokens: int = 120
    ignore_eos: bool = False
    min_tokens: int = 0

    def request(self) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, structured=self.structured,
        )  # fmt: skip
        return pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=self.question)], sampling=sampling
        )


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: int
    completion_tokens: int


def greedy_and_sampled(
    question: str, structured: pb.StructuredOutput, *sampled: tuple[float, int]
) -> list[Case]:
    """The question greedy, then at each (temperature, seed)."""
    return [Case(question, structured), *(Case(question, structured, t, seed) for t, seed in sampled)]


CONSTRAINED = [
    *greedy_and_sampled(
        "Describe a person as JSON with name, age and favourite color.",
        pb.StructuredOutput(json_schema=json.dumps(PERSON)), (1.0, 1), (0.8, 4),
    ),
    *greedy_and_sampled(
        "Give a JSON object with the keys city and country for Paris.",
        pb.StructuredOutput(json_object=True), (0.8, 11),
    ),
    *greedy_and_sampled("Name a city and a number.", pb.StructuredOutput(regex=REGEX), (1.0, 3)),
    *greedy_and_sampled("What is 6 times 7?", pb.StructuredOutput(grammar=GRAMMAR), (0.9, 5)),
    *greedy_and_sampled("Is the sky blue? Answer yes or no.", choice("yes", "no", "maybe"), (1.0, 6)),
]  # fmt: skip
FREE = [
    Case(q, max_tokens=24) for q in ("Name three fruits.", "What is the capital of France?", "Write a haiku.")
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--kv-memory", "256MiB") as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def eos_ids(stub: generation_pb2_grpc.GenerationStub) -> set[int]:
    return set(stub.GetModelInfo(pb.GetModelInfoRequest()).eos_token_ids)


def generate(stub: generation_pb2_grpc.GenerationStub, case: Case) -> Answer:
    """The whole streamed answer; a timeout so that a stuck request fails instead of hanging."""
    responses = list(stub.Generate(case.request(), timeout=120))
    last = responses[-1]
    token_ids = tuple(t for r in responses for t in r.token_ids)
    return Answer(
        "".join(r.text for r in responses), token_ids, last.finish_reason, last.usage.completion_tokens
    )


def concurrently(stub: generation_pb2_grpc.GenerationStub, cases: list[Case]) -> list[Answer]:
    """All the cases at once, on threads, so that they share the engine's steps; no call may fail."""

    def one(case: Case) -> Answer | str:
        try:
            return generate(stub, case)
        except grpc.RpcError as error:
            return f"{error.code()}: {error.details()}"

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(one, cases))
    failed = {
        f"{c.question} (seed {c.seed})": a for c, a in zip(cases, answers, strict=True) if isinstance(a, str)
    }
    assert not failed, failed
    return [answer for answer in answers if not isinstance(answer, str)]


def is_person(value: object) -> bool:
    """PERSON by hand (no jsonschema here): exactly its keys, each of its type and in its range."""
    if not isinstance(value, dict) or set(value) != {"name", "age", "color"}:
        return False
    name, age = value["name"], value["age"]
    ok_age = isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 120
    return isinstance(name, str) and len(name) <= 12 and ok_age and value["color"] in COLORS


def matches(structured: pb.StructuredOutput, text: str) -> bool:
    kind = structured.WhichOneof("kind")
    if kind == "json_schema":
        return is_person(json.loads(text))
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(structured.regex, text) is not None
    if kind == "grammar":
        return re.fullmatch(GRAMMAR_AS_REGEX, text) is not None
    return text in structured.choice.choices


def assert_ended_by_its_grammar(case: Case, answer: Answer, eos_ids: set[int]) -> None:
    assert case.structured is not None
    assert matches(case.structured, answer.text), (case, answer)
    # Ended by an EOS its grammar accepted, which is the last token and adds no text.
    assert answer.finish_reason == STOP and answer.token_ids[-1] in eos_ids, (case, answer)
    assert answer.completion_tokens == len(answer.token_ids)


def assert_still_serving(stack: Stack, stub: generation_pb2_grpc.GenerationStub) -> None:
    answer = generate(stub, Case("Say hello.", max_tokens=8))
    assert answer.text and answer.finish_reason in (STOP, LENGTH)
    wait_for_idle_worker(stack)
    wait_for_every_page(stack.daemon_address)


def test_a_mixed_batch_matches_every_constraint_and_leaves_free_rows_alone(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, eos_ids: set[int]
) -> None:
    answers = concurrently(stub, CONSTRAINED + FREE)
    for case, answer in zip(CONSTRAINED, answers, strict=False):
        assert_ended_by_its_grammar(case, answer, eos_ids)
    # The other rows' masks must not leak into the free ones: greedy, they answer as they do alone.
    for case, batched in zip(FREE, answers[len(CONSTRAINED) :], strict=True):
        assert batched.token_ids and batched == generate(stub, case), case
    assert_still_serving(stack, stub)


def test_every_seed_samples_inside_the_grammar(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub, eos_ids: set[int]
) -> None:
    """At temperature 1 each draw comes from the tokens the grammar allows, whatever the seed's noise."""
    cases = [Case("Is the sky blue?", choice("yes", "no"), 1.0, seed) for seed in range(40)]
    for case, answer in zip(cases, concurrently(stub, cases), strict=True):
        assert_ended_by_its_grammar(case, answer, eos_ids)
    assert_still_serving(stack, stub)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ignore_eos_cannot_outlast_a_finished_choice(
    stub: generation_pb2_grpc.GenerationStub, eos_ids: set[int], tokenizer: Tokenizer, temperature: float
) -> None:
    sentences = ("The sky is blue today", "The sky is green today")
    case = Case("What colour is the sky?", choice(*sentences), temperature, 7, max_tokens=50, ignore_eos=True)
    answer = generate(stub, case)
    assert_ended_by_its_grammar(case, answer, eos_ids)
    # The choice's tokens, then the one EOS that ended the grammar: nothing after it.
    assert tokenizer.decode(list(answer.token_ids[:-1])) == answer.text
    # Without a constraint, ignore_eos runs to max_tokens.
    free = generate(stub, Case("Is the sky blue?", None, temperature, 7, max_tokens=20, ignore_eos=True))
    assert (free.finish_reason, free.completion_tokens, len(free.token_ids)) == (LENGTH, 20, 20)


BAD_CONSTRAINTS = [
    (pb.StructuredOutput(json_schema="{x"), "sampling.structured.json_schema is not JSON"),
    (pb.StructuredOutput(json_schema='{"type": "nope"}'), "sampling.structured.json_schema does not compile"),
    (pb.StructuredOutput(regex="("), "sampling.structured.regex does not compile"),
    (pb.StructuredOutput(regex="a" * 65537), "sampling.structured.regex is 65537 bytes; at most 65536"),
    (pb.StructuredOutput(regex=""), "sampling.structured.regex is empty"),
    (  # xgrammar says nothing of an infinite bound: the message still names a cause
        pb.StructuredOutput(json_schema='{"type": "integer", "minimum": -1e400}'),
        "does not compile: xgrammar gave no reason; a number too large for a float64",
    ),
    (pb.StructuredOutput(grammar="root ::= greeting"), 'Rule "greeting" is not defined'),
    (choice(), "sampling.structured.choice holds 0 strings"),
    (pb.StructuredOutput(), "sampling.structured is set but empty"),
    (pb.StructuredOutput(json_object=False), "sampling.structured.json_object is false"),
]


def test_bad_constraints_are_invalid_arguments(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub
) -> None:
    for structured, message in BAD_CONSTRAINTS:
        with pytest.raises(grpc.RpcError) as caught:
            generate(stub, Case("Hello.", structured, max_tokens=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (structured, caught.value.details())
        assert message in caught.value.details(), (structured, caught.value.details())
    assert_still_serving(stack, stub)


def test_min_tokens_past_the_grammars_end_fails_the_request(
    stack: Stack, stub: generation_pb2_grpc.GenerationStub
) -> None:
    case = Case("Is the sky blue?", choice("yes", "no"), max_tokens=40, min_tokens=30)
    with pytest.raises(grpc.RpcError) as caught:
        generate(stub, case)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
    assert "min_tokens (30) holds back the only end" in caught.value.details()
    assert_still_serving(stack, stub)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    """The worker's compiler for the default model, as services/worker/server.py makes it."""
    spec = load_spec(default_model_dir())
    return Grammars(tokenizer, spec.vocab_size, spec.eos_token_ids)


def test_the_same_constraint_compiles_once(grammars: Grammars, monkeypatch: pytest.MonkeyPatch) -> None:
    compiles: list[float] = []  # the seconds of each, as the worker's histogram gets them
    monkeypatch.setattr(grammars, "on_compile", compiles.append)
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    first = grammars.compiled(Constraint("json_schema", schema))
    assert len(compiles) == 1
    assert grammars.compiled(Constraint("json_schema", schema)) is first  # equal, not the same object
    assert len(compiles) == 1
    grammars.state(Constraint("json_schema", json.dumps({"type": "array"})))
    assert len(compiles) == 2


def test_a_long_compile_holds_up_no_other_requests_intake(
    grammars: Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema may take a minute to compile (2300 optional properties took 80 s). Meanwhile the worker's
    event loop takes other structured requests (state_later): one with a cached grammar starts at once, a
    new one queues; neither waits on the compile, or the worker falls silent and is failed over."""
    slow = Constraint("json_schema", json.dumps({"type": "object", "title": "slow"}))
    cached = Constraint("json_schema", json.dumps({"type": "object", "title": "cached"}))
    grammars.compiled(cached)
    compiling, release = threading.Event(), threading.Event()
    compile_now = grammars._compile

    def held_compile(constraint: Constraint) -> object:
        if constraint == slow:
            compiling.set()
            release.wait(60)
        return compile_now(constraint)

    monkeypatch.setattr(grammars, "_compile", held_compile)
    pending = grammars.state_later(slow)
    assert compiling.wait(10)
    taken: list[concurrent.futures.Future] = []
    intake = threading.Thread(
        target=lambda: taken.extend(grammars.state_later(c) for c in (cached, Constraint("json_object"))),
        daemon=True,
    )
    intake.start()
    intake.join(10)
    try:
        assert len(taken) == 2, "the intake waited for another request's compile"
        assert taken[0].done() and not taken[1].done()  # the cached one at once; the new one after the slow
    finally:
        release.set()
    assert pending.result(60).terminated is False
    assert taken[1].result(60).terminated is False


@pytest.mark.parametrize(
    "choices", [('say "hi"', "a\\b", "café"), ("tab\tand\nline",), ("naïve ✓", "日本"), ("😀 ok", "x")]
)
def test_choices_that_need_escaping_constrain_exactly(
    grammars: Grammars, tokenizer: Tokenizer, choices: tuple[str, ...]
) -> None:
    """Greedy walks through random logits under the mask: each ends, after an EOS, at one of the choices."""
    seen = set()
    for seed in range(12):
        state = grammars.state(Constraint("choice", choices=choices))
        noise = torch.Generator().manual_seed(seed)
        token_ids: list[int] = []
        while not state.terminated and len(token_ids) < 64:
            logits = torch.randn(1, grammars.vocab_size, generator=noise)
            assert mask_logits(logits, [state]) == []
            token_ids.append(int(logits.argmax()))
            assert state.accept(token_ids[-1])
        assert state.terminated, token_ids
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert text in choices, (text, choices)
        seen.add(text)
    assert len(seen) > 1 or len(choices) == 1  # random logits reach more than one choice


def test_a_drafts_rows_are_masked_after_the_drafted_tokens_before_them(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Speculative decoding: the masks of a draft's rows are those a matcher stepped through the draft
    would give, and neither `allows` nor `fill_along` moves the matcher; a draft is cut where its grammar
    ends or refuses a token."""
    schema = json.dumps(
        {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    )
    constraint = Constraint("json_schema", schema)
    draft = tokenizer('{"name": "Ada", "n": 1815}', add_special_tokens=False)["input_ids"]
    eos = load_spec(default_model_dir()).eos_token_ids[0]
    state = grammars.state(constraint)
    assert state.allows([*draft, eos, draft[0]]) == len(draft)  # short of the end: nothing may follow it
    assert state.allows([*draft[:3], tokenizer("}}", add_special_tokens=False)["input_ids"][0]]) == 3
    masks = fill_masks([None, state], grammars.vocab_size, [(7, 8), draft])
    assert masks is not None and masks.shape[0] == 3 + len(draft) + 1
    assert bool((masks[:3] == -1).all())  # the row without a grammar, and its draft's, allow everything
    stepped = grammars.state(constraint)
    for row, token_id in enumerate([*draft, eos]):
        expected = fill_masks([stepped], grammars.vocab_size)
        assert expected is not None and torch.equal(masks[3 + row], expected[0]), f"row {row}"
        if token_id != eos:
            assert stepped.accept(token_id)
    again = fill_masks([state], grammars.vocab_size)  # the state has not moved
    assert again is not None and torch.equal(again[0], masks[3])
