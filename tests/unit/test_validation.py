"""RequestBuilder: from a public GenerateRequest's input (a prompt, prompt ids or chat messages) to prompt
ids that fit the context, and the sampling options as the client gave them, checked.

Sections: exactly one input; chat messages; the context; sampling options; stop strings and stop tokens;
and request ids.

The builder (the `builder` fixture, tests/unit/conftest.py) runs over the real SmolLM2 tokenizer with a
deliberately small context (64 tokens, tests/unit/validating.py), so that prompts over the context are easy
to write as prompt_token_ids. Every refusal is checked by its exact message, since that message is what the
client reads.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import ResourceExhausted
from services.client import generate_request
from services.common.sampling import SamplingOptions
from services.frontend.validation import (
    MAX_REQUEST_ID_LENGTH,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    RequestBuilder,
)
from tests.unit.validating import (
    DEFAULT_MAX_TOKENS,
    GENERATION_PROMPT,
    MAX_MODEL_LEN,
    TOKEN,
    VOCAB_SIZE,
    chat_ids,
    prepare,
    refusal,
)


@pytest.fixture(scope="module")
def tokenizer(frontend_tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The builder's own tokenizer, as the frontend loads it (the conftest's `tokenizer` is another)."""
    return frontend_tokenizer


# Exactly one input ----------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "Hi"}]


def test_no_input_is_refused(builder: RequestBuilder) -> None:
    assert refusal(builder, generate_request()) == (
        "the request has no input: set exactly one of prompt, prompt_token_ids or messages"
    )


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"prompt": "Hi", "token_ids": [1]}, "prompt and prompt_token_ids"),
        ({"prompt": "Hi", "messages": USER}, "prompt and messages"),
        ({"token_ids": [1], "messages": USER}, "prompt_token_ids and messages"),
        ({"prompt": "Hi", "token_ids": [1], "messages": USER}, "prompt and prompt_token_ids and messages"),
    ],
)
def test_more_than_one_input_is_refused(builder: RequestBuilder, kwargs: dict[str, Any], names: str) -> None:
    message = refusal(builder, generate_request(**kwargs))
    assert message == f"the request sets {names}; set exactly one input"


def test_prompt_text_is_tokenized(builder: RequestBuilder, tokenizer: PreTrainedTokenizerBase) -> None:
    prepared = prepare(builder, "Hello, world!")
    assert list(prepared.engine.prompt_ids) == tokenizer("Hello, world!")["input_ids"] == [19556, 28, 905, 17]


def test_prompt_token_ids_are_kept(builder: RequestBuilder) -> None:
    ids = [0, 1, 2, 17, VOCAB_SIZE - 1]
    assert prepare(builder, None, token_ids=ids).engine.prompt_ids == tuple(ids)


@pytest.mark.parametrize("ids", [[VOCAB_SIZE], [1, 2, VOCAB_SIZE + 7, 3]])
def test_prompt_token_out_of_vocabulary_is_named(builder: RequestBuilder, ids: list[int]) -> None:
    message = refusal(builder, generate_request(token_ids=ids))
    assert message == (
        f"prompt_token_ids holds {max(ids)}, which is not a token of this model (0..{VOCAB_SIZE - 1})"
    )


# Chat messages --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        USER,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "世界 🎉"},
        ],
    ],
)
def test_messages_are_rendered_through_the_chat_template(
    builder: RequestBuilder, tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> None:
    prompt_ids = list(prepare(builder, None, messages=messages).engine.prompt_ids)
    assert prompt_ids == chat_ids(tokenizer, messages)
    assert tokenizer.decode(prompt_ids).endswith(GENERATION_PROMPT)
    assert messages[-1]["content"] in tokenizer.decode(prompt_ids)


@pytest.mark.parametrize(("bad_role", "index"), [("bot", 1), ("", 0), ("User", 1)])
def test_unknown_role_names_its_index(builder: RequestBuilder, bad_role: str, index: int) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "again"}]
    messages[index] = {"role": bad_role, "content": "x"}
    expected = f"messages[{index}].role is {bad_role!r}; it must be one of system, user, assistant, tool"
    assert refusal(builder, generate_request(messages=messages)) == expected


# The context ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [None, 1, 100])
def test_prompt_one_short_of_the_context_keeps_max_tokens(
    builder: RequestBuilder, max_tokens: int | None
) -> None:
    """The request goes to the worker as the client asked: generation ends with LENGTH at the context's end
    (tests/integration/test_frontend_context.py), so the frontend has nothing to cut."""
    sampling = {} if max_tokens is None else {"max_tokens": max_tokens}
    prepared = prepare(builder, None, token_ids=[TOKEN] * (MAX_MODEL_LEN - 1), **sampling)
    assert len(prepared.engine.prompt_ids) == 63
    assert prepared.engine.options.max_tokens == (max_tokens or DEFAULT_MAX_TOKENS)


@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 36])
def test_prompt_filling_the_context_is_refused(builder: RequestBuilder, length: int) -> None:
    message = refusal(builder, generate_request(token_ids=[TOKEN] * length), ResourceExhausted)
    assert message == (
        f"the prompt has {length} tokens, but the model's context is 64 tokens and at least one must be left "
        "to generate; shorten the prompt"
    )


def test_text_over_the_context_is_refused_once_tokenized(
    builder: RequestBuilder, tokenizer: PreTrainedTokenizerBase
) -> None:
    text = "word " * MAX_MODEL_LEN  # short enough in characters to reach the tokenizer
    tokens = len(tokenizer(text)["input_ids"])
    message = refusal(builder, generate_request(text), ResourceExhausted)
    assert message.startswith(f"the prompt has {tokens} tokens, but the model's context is 64 tokens")


# Sampling options -----------------------------------------------------------------------------------------


def test_unset_fields_get_their_defaults(builder: RequestBuilder) -> None:
    prepared = prepare(builder)
    assert prepared.engine.options == SamplingOptions(
        max_tokens=DEFAULT_MAX_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=None,
        stop_token_ids=(),
        ignore_eos=False,
        logprobs=0,
    )
    assert prepared.stop == ()
    assert prepared.engine.priority == 0


def test_set_fields_are_kept(builder: RequestBuilder) -> None:
    # Values exact in float32, the proto's type.
    prepared = prepare(
        builder,
        max_tokens=3,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=-1.25,
        seed=1234,
        stop=["END", "世界"],
        stop_token_ids=[2, 7],
        ignore_eos=True,
        logprobs=5,
        priority=3,
    )
    assert prepared.engine.options == SamplingOptions(
        max_tokens=3,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=-1.25,
        seed=1234,
        stop_token_ids=(2, 7),
        ignore_eos=True,
        logprobs=5,
    )
    assert prepared.stop == ("END", "世界")
    assert prepared.engine.priority == 3


def test_explicit_zero_temperature_is_greedy(builder: RequestBuilder) -> None:
    options = prepare(builder, temperature=0.0).engine.options
    assert options.temperature == 0.0
    assert options.greedy is True
    assert prepare(builder).engine.options.greedy is False


@pytest.mark.parametrize(("seed", "expected"), [(None, None), (0, 0), (-5, -5), (2**62, 2**62)])
def test_seed_is_none_unless_set(builder: RequestBuilder, seed: int | None, expected: int | None) -> None:
    sampling = {} if seed is None else {"seed": seed}
    assert prepare(builder, **sampling).engine.options.seed == expected


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -1.0, "sampling.temperature must be between 0.0 and 100.0, got -1.0"),
        ("temperature", 101.0, "sampling.temperature must be between 0.0 and 100.0, got 101.0"),
        ("top_p", 0.0, "sampling.top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "sampling.top_p must be in (0, 1], got 1.5"),
        ("repetition_penalty", math.nan, "sampling.repetition_penalty must be a finite number, got nan"),
        ("repetition_penalty", 0.0, "sampling.repetition_penalty must be between 0.001 and 100.0, got 0.0"),
        (
            "repetition_penalty",
            1e-39,
            "sampling.repetition_penalty must be between 0.001 and 100.0, got 1.0000002153053333e-39",
        ),
        ("temperature", math.inf, "sampling.temperature must be a finite number, got inf"),
        ("min_p", 1.5, "sampling.min_p must be between 0.0 and 1.0, got 1.5"),
        ("presence_penalty", 2.5, "sampling.presence_penalty must be between -2.0 and 2.0, got 2.5"),
        ("frequency_penalty", -3.0, "sampling.frequency_penalty must be between -2.0 and 2.0, got -3.0"),
        ("top_k", -2, "sampling.top_k must be between -1 and 1048576, got -2"),
        ("logprobs", 21, "sampling.logprobs must be between 0 and 20, got 21"),
        ("max_tokens", 0, "sampling.max_tokens must be between 1 and 1048576, got 0"),
        ("max_tokens", -1, "sampling.max_tokens must be between 1 and 1048576, got -1"),
    ],
)
def test_bad_sampling_value_names_the_field(
    builder: RequestBuilder, field: str, value: float, message: str
) -> None:
    assert refusal(builder, generate_request("Hello", **{field: value})) == message


# Stop strings and stop tokens -----------------------------------------------------------------------------


def test_stop_strings_up_to_the_limits_are_accepted(builder: RequestBuilder) -> None:
    stop = [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["x" * MAX_STOP_LENGTH]
    assert prepare(builder, stop=stop).stop == tuple(stop)
    wide = "世" * MAX_STOP_LENGTH  # the limit counts characters, not bytes
    assert prepare(builder, stop=[wide]).stop == (wide,)


def test_too_many_stop_strings_are_refused(builder: RequestBuilder) -> None:
    stop = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    message = refusal(builder, generate_request("Hello", stop=stop))
    assert message == "sampling.stop holds 17 strings; at most 16"


@pytest.mark.parametrize(("stop", "index", "length"), [(["ok", ""], 1, 0), (["x" * 257, "ok"], 0, 257)])
def test_empty_or_long_stop_string_is_refused(
    builder: RequestBuilder, stop: list[str], index: int, length: int
) -> None:
    message = refusal(builder, generate_request("Hello", stop=stop))
    assert message == f"sampling.stop[{index}] must be 1 to 256 characters, got {length}"


def test_stop_token_ids_in_vocabulary_are_kept(builder: RequestBuilder) -> None:
    options = prepare(builder, stop_token_ids=[0, VOCAB_SIZE - 1]).engine.options
    assert options.stop_token_ids == (0, VOCAB_SIZE - 1)


def test_stop_token_id_out_of_vocabulary_is_refused(builder: RequestBuilder) -> None:
    message = refusal(builder, generate_request("Hello", stop_token_ids=[2, 3, VOCAB_SIZE]))
    assert message == "sampling.stop_token_ids holds 49152, which is not a token of this model (0..49151)"


def test_too_many_stop_token_ids_are_refused(builder: RequestBuilder) -> None:
    message = refusal(builder, generate_request("Hello", stop_token_ids=list(range(65))))
    assert message == "sampling.stop_token_ids holds at most 64 ids"


# Request ids ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("request_id", ["req-1", "x" * MAX_REQUEST_ID_LENGTH, "世界"])
def test_given_request_id_is_kept(builder: RequestBuilder, request_id: str) -> None:
    assert prepare(builder, request_id=request_id).request_id == request_id


def test_empty_request_id_is_generated(builder: RequestBuilder) -> None:
    first, second = prepare(builder).request_id, prepare(builder).request_id
    assert re.fullmatch(r"[0-9a-f]{32}", first), first
    assert re.fullmatch(r"[0-9a-f]{32}", second), second
    assert first != second


def test_overlong_request_id_is_refused(builder: RequestBuilder) -> None:
    message = refusal(builder, generate_request("Hello", request_id="x" * (MAX_REQUEST_ID_LENGTH + 1)))
    assert message == "request_id is 257 characters; at most 256"
