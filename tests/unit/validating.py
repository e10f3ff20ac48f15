"""For the RequestBuilder tests: a deliberately small context (64 tokens), so that prompts over the context
are easy to write as prompt_token_ids, and a request prepared as the frontend prepares it (its id minted,
checked, tokenized), or its exact refusal.
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.v1 import generation_pb2
from services.client import generate_request
from services.common.request import ModelLimits
from services.frontend.validation import PreparedRequest, RequestBuilder, request_id_of

VOCAB_SIZE = 49152
MAX_MODEL_LEN = 64
DEFAULT_MAX_TOKENS = 10
TOKEN = 5  # any ordinary token id, for prompts of an exact length
GENERATION_PROMPT = "<|im_start|>assistant\n"
LIMITS = ModelLimits(vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN)


def prepare(builder: RequestBuilder, prompt: str | None = "Hello", **kwargs: Any) -> PreparedRequest:
    return prepared(builder, generate_request(prompt, **kwargs))


def prepared(builder: RequestBuilder, request: generation_pb2.GenerateRequest) -> PreparedRequest:
    """The request as the frontend prepares it: its id minted, then checked, then tokenized."""
    checked = builder.check(request, request_id_of(request.request_id), LIMITS)
    return builder.tokenize(checked, LIMITS)


def refusal(
    builder: RequestBuilder, request: generation_pb2.GenerateRequest, error: type[Exception] = InvalidArgument
) -> str:
    """The message of the exception preparing raises; the test fails if it raises nothing or another type."""
    with pytest.raises(error) as info:
        prepared(builder, request)
    assert type(info.value) is error
    return str(info.value)


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
