"""Sampling options: one checked dataclass that the frontend builds from a request and the worker obeys.

The meanings are vLLM's SamplingParams'. Each field has the name of its `pagedserve.v1.SamplingParams`
field, which is how the servicers convert (`services.common.wire`). Bad values raise InvalidArgument with a
message that says which field and what range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.plumbing.errors import InvalidArgument
from services.common.structured import Constraint

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # as vLLM: a smaller temperature is greedy, and dividing by it would overflow fp32
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API
LOGIT_BIAS_RANGE = 100.0


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 (below 1e-5) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # top-n log-probabilities per token
    min_tokens: int = 0  # EOS and stop tokens are held back until this many are out
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by token id
    structured: Constraint | None = None
    prompt_logprobs: int | None = None  # top-n at each prompt position; None: no prompt logprobs
    speculative: bool = True  # False: this request decodes one token a step, whatever the worker runs

    def __post_init__(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise InvalidArgument(f"sampling.{name} must be a finite number, got {getattr(self, name)}")
        _check_range("max_tokens", self.max_tokens, 1, 1 << 20)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        _check_range("top_k", self.top_k, -1, 1 << 20)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        # Above zero and then some: a positive logit is divided by it, and 1e-39 made it inf and the
        # probabilities NaN.
        _check_range("repetition_penalty", self.repetition_penalty, 0.001, 100.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            _check_range("seed", self.seed, -(1 << 63), (1 << 63) - 1)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"sampling.stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids")
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.prompt_logprobs is not None:
            _check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _check_logit_bias(bias: tuple[tuple[int, float], ...]) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"sampling.logit_bias holds {len(bias)} tokens; at most {MAX_LOGIT_BIAS}")
    for token_id, value in bias:
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:  # NaN fails too
            raise InvalidArgument(
                f"sampling.logit_bias[{token_id}] is {value}; a bias must be between "
                f"{-LOGIT_BIAS_RANGE} and {LOGIT_BIAS_RANGE}"
            )


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidArgument(f"sampling.{name} must be between {low} and {high}, got {value}")
