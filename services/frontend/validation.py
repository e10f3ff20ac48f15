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

from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument, ResourceExhausted
from pagedserve.v1 import generation_pb2
from services.common.limits import check_prompt_fits
from services.common.sampling import SamplingOptions
from services.common.wire import sampling_from_pb
from services.frontend.chat import ChatRenderer

MAX_STOP_STRINGS = 16
MAX_SAMPLES = 16  # n
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID_LENGTH = 256
MAX_CACHE_SALT_BYTES = 256
# A prompt's text may be at most this many characters a token of the model's context: a bound checked before
# any tokenizer runs, generous for real text (about 4 characters a token), so that megabytes of text cost
# microseconds to refuse, not seconds and gigabytes to tokenize.
CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class CheckedRequest:
    """A request with every field checked, but its text, which the tokenizer has yet to turn into ids."""

    request: generation_pb2.GenerateRequest
    options: SamplingOptions  # max_tokens not yet cut to the room the prompt leaves
    stop: tuple[str, ...]
    cache_salt: str
    n: int = 1  # samples


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions
    stop: tuple[str, ...]
    priority: int
    cache_salt: str = ""


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

    def prepare(self, request: generation_pb2.GenerateRequest, limits: ModelLimits) -> PreparedRequest:
        return self.tokenize(self.check(request, limits), limits)

    def check(self, request: generation_pb2.GenerateRequest, limits: ModelLimits) -> CheckedRequest:
        """Every check that needs no tokenizer, so that a bad request is refused before it is admitted."""
        if len(request.request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidArgument(
                f"request_id is {len(request.request_id)} characters; at most {MAX_REQUEST_ID_LENGTH}"
            )
        _check_one_input(request.prompt, request.prompt_token_ids, request.messages)
        _check_priority(request.priority, self.priorities)
        _check_tokens("prompt_token_ids", request.prompt_token_ids, limits.vocab_size)
        sampling = request.sampling
        _check_tokens("sampling.stop_token_ids", sampling.stop_token_ids, limits.vocab_size)
        if sampling.logit_bias and (most := max(sampling.logit_bias)) >= limits.vocab_size:
            raise InvalidArgument(
                f"sampling.logit_bias has token id {most}, which is not a token of this model "
                f"(0..{limits.vocab_size - 1})"
            )
        defaults = {} if sampling.HasField("max_tokens") else {"max_tokens": self.default_max_tokens}
        options = sampling_from_pb(sampling, **defaults)
        n = sampling.n if sampling.HasField("n") else 1
        if not 1 <= n <= MAX_SAMPLES:
            raise InvalidArgument(f"sampling.n is {n}; a request takes 1 to {MAX_SAMPLES} samples")
        stop = _stop_strings(sampling.stop)
        return CheckedRequest(request, options, stop, _cache_salt(request.cache_salt), n)

    def tokenize(self, checked: CheckedRequest, limits: ModelLimits) -> PreparedRequest:
        request = checked.request
        prompt_ids = self.prompt_ids(request.prompt, request.prompt_token_ids, request.messages)
        room = check_prompt_fits(len(prompt_ids), limits.max_model_len)
        # Never ask for more than the context has room for: generation would stop there anyway.
        most = min(checked.options.max_tokens, room)
        options = dataclasses.replace(
            checked.options, max_tokens=most, min_tokens=min(checked.options.min_tokens, most)
        )
        return PreparedRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            options=options,
            stop=checked.stop,
            priority=request.priority,
            cache_salt=checked.cache_salt,
        )

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


def check_sizes(
    text: str, messages: Sequence[generation_pb2.ChatMessage], limits: ModelLimits, num_token_ids: int = 0
) -> None:
    """Refuse, before tokenizing, an input that cannot fit the context: by its length alone."""
    if num_token_ids:
        check_prompt_fits(num_token_ids, limits.max_model_len)
    chars = len(text) + sum(len(m.content) + len(m.role) for m in messages)
    most = limits.max_model_len * CHARS_PER_TOKEN
    if chars > most:
        raise ResourceExhausted(
            f"the prompt has {chars} characters, but the model's context is {limits.max_model_len} tokens, "
            f"which takes at most {most} characters ({CHARS_PER_TOKEN} a token); shorten the prompt"
        )


def _check_priority(priority: int, priorities: tuple[int, int]) -> None:
    lowest, highest = priorities
    if not lowest <= priority <= highest:
        raise InvalidArgument(
            f"priority is {priority}; this server takes {lowest} to {highest} (lower runs first), "
            "a range its operator sets with --min-priority and --max-priority"
        )


def _check_tokens(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    if not token_ids or max(token_ids) < vocab_size:  # max() runs in C: a million ids take ms
        return
    for i, token in enumerate(token_ids):
        if token >= vocab_size:
            raise InvalidArgument(
                f"{field}[{i}] is {token}, which is not a token of this model (0..{vocab_size - 1})"
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
