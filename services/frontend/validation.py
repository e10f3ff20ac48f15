"""From a public GenerateRequest to what a worker runs: prompt token ids and checked sampling options.

Every refusal is InvalidArgument, or ResourceExhausted for a prompt over the context, with a message that
names the field and says what to change. The model's limits come from its workers (`ModelLimits`), which
run the model: the frontend never loads the model's code.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.v1 import generation_pb2
from services.common.limits import check_prompt_fits
from services.common.sampling import SamplingOptions
from services.common.wire import sampling_from_pb

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID_LENGTH = 256


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions
    stop: tuple[str, ...]
    priority: int


class RequestBuilder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, default_max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens

    def prepare(self, request: generation_pb2.GenerateRequest, limits: ModelLimits) -> PreparedRequest:
        if len(request.request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidArgument(
                f"request_id is {len(request.request_id)} characters; at most {MAX_REQUEST_ID_LENGTH}"
            )
        prompt_ids = self.prompt_ids(
            request.prompt, request.prompt_token_ids, request.messages, vocab_size=limits.vocab_size
        )
        room = check_prompt_fits(len(prompt_ids), limits.max_model_len)
        sampling = request.sampling
        _check_tokens("sampling.stop_token_ids", sampling.stop_token_ids, limits.vocab_size)
        defaults = {} if sampling.HasField("max_tokens") else {"max_tokens": self.default_max_tokens}
        options = sampling_from_pb(sampling, **defaults)
        # Never ask for more than the context has room for: generation would stop there anyway.
        options = dataclasses.replace(options, max_tokens=min(options.max_tokens, room))
        return PreparedRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            options=options,
            stop=_stop_strings(sampling.stop),
            priority=request.priority,
        )

    def prompt_ids(
        self,
        prompt: str,
        token_ids: Sequence[int],
        messages: Sequence[generation_pb2.ChatMessage],
        *,
        vocab_size: int | None = None,
    ) -> list[int]:
        """The one input of a request, as token ids; token ids given are checked against vocab_size."""
        given = [
            name
            for name, value in (("prompt", prompt), ("prompt_token_ids", token_ids), ("messages", messages))
            if value
        ]
        if not given:
            raise InvalidArgument(
                "the request has no input: set exactly one of prompt, prompt_token_ids or messages"
            )
        if len(given) > 1:
            raise InvalidArgument(f"the request sets {' and '.join(given)}; set exactly one input")
        if token_ids:
            if vocab_size is not None:
                _check_tokens("prompt_token_ids", token_ids, vocab_size)
            return list(token_ids)
        if messages:
            return self._chat(messages)
        ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise InvalidArgument("the prompt tokenizes to nothing")
        return list(ids)

    def _chat(self, messages: Sequence[generation_pb2.ChatMessage]) -> list[int]:
        for i, message in enumerate(messages):
            if message.role not in ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role is {message.role!r}; it must be one of {', '.join(ROLES)}"
                )
        if self.tokenizer.chat_template is None:
            raise InvalidArgument("this model has no chat template; send a prompt instead of messages")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            ids: Any = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        except TemplateError as exc:
            raise InvalidArgument(f"the model's chat template refused these messages: {exc}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _check_tokens(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    if not token_ids or max(token_ids) < vocab_size:  # max() runs in C: a million ids take ms
        return
    for i, token in enumerate(token_ids):
        if token >= vocab_size:
            raise InvalidArgument(
                f"{field}[{i}] is {token}, which is not a token of this model (0..{vocab_size - 1})"
            )


def _stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(stop):
        if not 0 < len(text) <= MAX_STOP_LENGTH:
            raise InvalidArgument(
                f"sampling.stop[{i}] must be 1 to {MAX_STOP_LENGTH} characters, got {len(text)}"
            )
    return tuple(stop)
