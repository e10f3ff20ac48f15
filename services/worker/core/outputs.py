"""What the engine core hands back after each step: plain values, which the servicer turns into messages."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from pagedserve.plumbing.errors import StatusError
from services.worker.core.sequence import FinishReason, Sequence, TokenLogprob


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
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with the first token, when asked

    @classmethod
    def of(
        cls,
        seq: Sequence,
        token_ids: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        error: StatusError | None = None,
    ) -> RequestOutput:
        """The sequence's output now: its new tokens, and its finish reason once it has one; the prompt's
        log-probabilities go with its first token."""
        first = token_ids is not None and seq.num_known - len(token_ids) == seq.prompt_len
        return cls(
            seq.key,
            token_ids or [],
            logprobs or [],
            seq.finish_reason,
            seq.prompt_len,
            seq.cached_prompt_tokens,
            error,
            seq.prompt_logprobs if first else [],
        )
