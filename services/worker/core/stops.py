"""When a sequence ends: the stop rules its tokens meet, and why a constrained one cannot go on."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.plumbing.errors import FailedPrecondition
from services.worker.core.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class StopRules:
    eos_token_ids: frozenset[int]
    max_model_len: int

    def reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why the sequence ends with this token, its last known one; None if it goes on."""
        options = seq.options
        if token in options.stop_token_ids or (not options.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.terminated:  # ended by an EOS, even with ignore_eos
            return FinishReason.STOP
        return FinishReason.LENGTH if self._full(seq, seq.num_known) else None

    def ends_in_flight(self, seq: Sequence) -> bool:
        """Whether the token on its way ends the sequence, whatever it is."""
        return seq.in_flight > 0 and self._full(seq, seq.num_tokens)

    def _full(self, seq: Sequence, tokens: int) -> bool:
        """Whether a sequence of this many tokens has reached max_tokens or the context's end."""
        return tokens - seq.prompt_len >= seq.options.max_tokens or tokens >= self.max_model_len


def dead_end(seq: Sequence) -> FailedPrecondition:
    out = seq.num_known - seq.prompt_len
    why = "its structured output allows no token of this model"
    if out < seq.options.min_tokens:
        why = f"min_tokens ({seq.options.min_tokens}) holds back the only end its structured output allows"
    return FailedPrecondition(f"the request stopped after {out} tokens: {why}")
