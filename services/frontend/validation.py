"""From a public GenerateRequest to what a worker runs: prompt token ids and checked sampling options.

Every refusal is a ValueError (INVALID_ARGUMENT) or ResourceExhausted (a prompt over the context) whose
message names the field and says what to change.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2
from services.common.errors import ResourceExhausted
from services.common.sampling import SamplingOptions

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID_LENGTH = 256


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions
    stop: tuple[str, ...]
    priority: int


class RequestBuilder:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        vocab_size: int,
        max_model_len: int,
        default_max_tokens: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens

    def prepare(self, request: generation_pb2.GenerateRequest) -> PreparedRequest:
        if len(request.request_id) > MAX_REQUEST_ID_LENGTH:
            raise ValueError(
                f"request_id is {len(request.request_id)} characters; at most {MAX_REQUEST_ID_LENGTH}"
            )
        prompt_ids = self.prompt_ids(request.prompt, request.prompt_token_ids, request.messages)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ResourceExhausted(
                f"the prompt has {len(prompt_ids)} tokens, but the model's context is {self.max_model_len} "
                "tokens and at least one must be left to generate; shorten the prompt"
            )
        options = self._options(request.sampling)
        # Never ask for more than the context has room for: generation would stop there anyway.
        options = dataclasses.replace(options, max_tokens=min(options.max_tokens, room))
        return PreparedRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            options=options,
            stop=self._stop_strings(request.sampling.stop),
            priority=request.priority,
        )

    def prompt_ids(
        self, prompt: str, token_ids: list[int], messages: list[generation_pb2.ChatMessage]
    ) -> list[int]:
        """The one input of a request, as token ids."""
        given = [
            name
            for name, value in (("prompt", prompt), ("prompt_token_ids", token_ids), ("messages", messages))
            if value
        ]
        if not given:
            raise ValueError(
                "the request has no input: set exactly one of prompt, prompt_token_ids or messages"
            )
        if len(given) > 1:
            raise ValueError(f"the request sets {' and '.join(given)}; set exactly one input")
        if token_ids:
            self._check_tokens("prompt_token_ids", token_ids)
            return list(token_ids)
        if messages:
            return self._chat(messages)
        ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError("the prompt tokenizes to nothing")
        return list(ids)

    def _chat(self, messages: list[generation_pb2.ChatMessage]) -> list[int]:
        for i, message in enumerate(messages):
            if message.role not in ROLES:
                raise ValueError(
                    f"messages[{i}].role is {message.role!r}; it must be one of {', '.join(ROLES)}"
                )
        if self.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template; send a prompt instead of messages")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        except TemplateError as exc:
            raise ValueError(f"the model's chat template refused these messages: {exc}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _options(self, sampling: generation_pb2.SamplingParams) -> SamplingOptions:
        def optional(name: str, default: float) -> float:
            return getattr(sampling, name) if sampling.HasField(name) else default

        self._check_tokens("sampling.stop_token_ids", sampling.stop_token_ids)
        return SamplingOptions(
            max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else self.default_max_tokens,
            temperature=optional("temperature", 1.0),
            top_p=optional("top_p", 1.0),
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            repetition_penalty=optional("repetition_penalty", 1.0),
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            seed=sampling.seed if sampling.HasField("seed") else None,
            stop_token_ids=tuple(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=sampling.logprobs,
        )

    def _check_tokens(self, field: str, token_ids: list[int]) -> None:
        if not token_ids or max(token_ids) < self.vocab_size:  # max() runs in C: a million ids take ms
            return
        for i, token in enumerate(token_ids):
            if token >= self.vocab_size:
                raise ValueError(
                    f"{field}[{i}] is {token}, which is not a token of this model (0..{self.vocab_size - 1})"
                )

    @staticmethod
    def _stop_strings(stop: list[str]) -> tuple[str, ...]:
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"sampling.stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
        for i, text in enumerate(stop):
            if not 0 < len(text) <= MAX_STOP_LENGTH:
                raise ValueError(
                    f"sampling.stop[{i}] must be 1 to {MAX_STOP_LENGTH} characters, got {len(text)}"
                )
        return tuple(stop)
