"""RequestBuilder: from a public GenerateRequest's input (a prompt, prompt ids or chat messages) to prompt
ids that fit the context, and the sampling options as the client gave them.

The builder (the `builder` fixture, tests/unit/conftest.py) runs over the real SmolLM2 tokenizer with a
deliberately small context (64 tokens), so that prompts over the context are easy to write as
prompt_token_ids. Every refusal is checked by its exact message, since that message is what the client reads.
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import ResourceExhausted
from services.client import generate_request
from services.frontend.validation import RequestBuilder
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
