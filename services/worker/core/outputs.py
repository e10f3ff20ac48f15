"""What the engine core hands back after each step: plain values, which the servicer turns into messages."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from pagedserve.plumbing.errors import StatusError
from services.worker.core.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the n most likely tokens and their log-probabilities


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request; the last one carries its finish reason."""

    key: Hashable
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token, when the request asked
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: StatusError | None = None  # why the engine refused or failed the request

    @classmethod
    def of(
        cls,
        seq: Sequence,
        token_ids: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        error: StatusError | None = None,
    ) -> RequestOutput:
        """The sequence's output now: its new tokens, and its finish reason once it has one."""
        return cls(
            seq.key,
            token_ids or [],
            logprobs or [],
            seq.finish_reason,
            seq.prompt_len,
            seq.cached_prompt_tokens,
            error,
        )
