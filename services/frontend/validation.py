"""From a public GenerateRequest to what a worker runs: an `EngineRequest` of prompt token ids and checked
sampling options.

Every refusal is InvalidArgument, or ResourceExhausted for a prompt over the context, with a message that
names the field and says what to change. The checks a worker makes too are `services.common.request`'s, so
that both give one message for one condition. The model's limits come from its workers (`ModelLimits`),
which run the model: the frontend never loads the model's code.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.plumbing.pin_limits import check_ttl
from pagedserve.v1 import generation_pb2
from services.common.request import (
    EngineRequest,
    ModelLimits,
    check_prompt_fits,
    check_request,
    check_text_fits,
    check_token_ids,
)
from services.common.sampling import SamplingOptions
from services.common.wire import sampling_from_pb
from services.frontend.chat import ChatRenderer

MAX_STOP_STRINGS = 16
MAX_SAMPLES = 16  # n
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID_LENGTH = 256
MAX_CACHE_SALT_BYTES = 256


@dataclass(frozen=True)
class CheckedRequest:
    """A request with every field checked, but its text, which the tokenizer has yet to turn into ids."""

    request: generation_pb2.GenerateRequest
    request_id: str
    options: SamplingOptions
    stop: tuple[str, ...]
    cache_salt: str
    n: int = 1  # samples
    cache_ttl_seconds: int = 0  # how long its pages stay pinned after it ends
    tenant: str = ""  # whose pin budget pays for them (`ClientIdentity.tenant`)


@dataclass(frozen=True)
class PreparedRequest:
    """A request as its worker runs it, with what stays in the frontend: its id, and its stop strings."""

    request_id: str
    engine: EngineRequest
    stop: tuple[str, ...]


def request_id_of(given: str) -> str:
    """A call's request id, minted where the call comes in: the client's own, checked, else a fresh one."""
    if len(given) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument(f"request_id is {len(given)} characters; at most {MAX_REQUEST_ID_LENGTH}")
    return given or uuid.uuid4().hex


def text_length(text: str, messages: Sequence[generation_pb2.ChatMessage]) -> int:
    """The characters of a text or chat input, its roles included: what `check_text_fits` bounds."""
    return len(text) + sum(len(m.content) + len(m.role) for m in messages)


class RequestBuilder:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        default_max_tokens: int,
        priorities: tuple[int, int] = (0, 1000),
    ) -> None:
        """priorities: the lowest (most favourable) and highest priority a request may ask for."""
        self.tokenizer = tokenizer
        self.chat = ChatRenderer(tokenizer)
        self.default_max_tokens = default_max_tokens
        self.priorities = priorities

    def check(
        self, request: generation_pb2.GenerateRequest, request_id: str, limits: ModelLimits
    ) -> CheckedRequest:
        """Every check that needs no tokenizer, so that a bad request is refused before it is admitted; its
        sizes first, so that an oversized prompt is refused in microseconds."""
        check_text_fits(text_length(request.prompt, request.messages), limits)
        check_prompt_fits(len(request.prompt_token_ids), limits.max_model_len)
        _check_one_input(request.prompt, request.prompt_token_ids, request.messages)
        _check_priority(request.priority, self.priorities)
        check_token_ids("prompt_token_ids", request.prompt_token_ids, limits.vocab_size)
        sampling = request.sampling
        check_token_ids("sampling.stop_token_ids", sampling.stop_token_ids, limits.vocab_size)
        check_token_ids("sampling.logit_bias", list(sampling.logit_bias), limits.vocab_size)
        defaults = {} if sampling.HasField("max_tokens") else {"max_tokens": self.default_max_tokens}
        options = sampling_from_pb(sampling, **defaults)
        n = sampling.n if sampling.HasField("n") else 1
        if not 1 <= n <= MAX_SAMPLES:
            raise InvalidArgument(f"sampling.n is {n}; a request takes 1 to {MAX_SAMPLES} samples")
        stop = _stop_strings(sampling.stop)
        check_ttl(request.cache_ttl_seconds)
        salt = _cache_salt(request.cache_salt)
        return CheckedRequest(request, request_id, options, stop, salt, n, request.cache_ttl_seconds)

    def tokenize(self, checked: CheckedRequest, limits: ModelLimits) -> PreparedRequest:
        """The request as its worker runs it, checked as the worker checks it: a text prompt's ids may be
        over the context, and a chat template's outside the model's vocabulary."""
        request = checked.request
        prompt_ids = self.prompt_ids(request.prompt, request.prompt_token_ids, request.messages)
        engine = EngineRequest(
            tuple(prompt_ids),
            checked.options,
            request.priority,
            checked.cache_salt,
            cache_ttl_seconds=checked.cache_ttl_seconds,
            tenant=checked.tenant,
        )
        check_request(engine, limits)
        return PreparedRequest(checked.request_id, engine, checked.stop)

    def prompt_ids(
        self, prompt: str, token_ids: Sequence[int], messages: Sequence[generation_pb2.ChatMessage]
    ) -> list[int]:
        """The one input of a request, as token ids."""
        _check_one_input(prompt, token_ids, messages)
        if token_ids:
            return list(token_ids)
        if messages:
            return self.chat.ids(messages)
        ids = self.text_ids(prompt)
        if not ids:
            raise InvalidArgument("the prompt tokenizes to nothing")
        return ids

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _check_one_input(
    prompt: str, token_ids: Sequence[int], messages: Sequence[generation_pb2.ChatMessage]
) -> None:
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


def _check_priority(priority: int, priorities: tuple[int, int]) -> None:
    lowest, highest = priorities
    if not lowest <= priority <= highest:
        raise InvalidArgument(
            f"priority is {priority}; this server takes {lowest} to {highest} (lower runs first), "
            "a range its operator sets with --min-priority and --max-priority"
        )


def _cache_salt(salt: str) -> str:
    if len(salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument(f"cache_salt is {len(salt.encode())} bytes; at most {MAX_CACHE_SALT_BYTES}")
    return salt


def _stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(stop):
        if not 0 < len(text) <= MAX_STOP_LENGTH:
            raise InvalidArgument(
                f"sampling.stop[{i}] must be 1 to {MAX_STOP_LENGTH} characters, got {len(text)}"
            )
    return tuple(stop)
