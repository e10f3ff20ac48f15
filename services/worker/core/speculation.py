"""Speculative decoding: tokens a sequence will likely produce next (a draft), checked by the model in the
sequence's next step, which then gives up to the draft's length plus one token instead of one.

`--speculative ngram` is prompt lookup: the sequence's last n tokens (n from MAX_NGRAM down to MIN_NGRAM) are
looked up in its earlier tokens, prompt and output, and what followed their latest earlier occurrence is the
draft. It needs no model, and it wins where the output copies its input (edits, quotes, extraction).

How a draft is checked (the scheduler's `_take_tokens`): the step runs the sequence's last token and the
draft as one chunk, and draws a token at each of its positions exactly as a step without speculation would
once the draft's tokens before it were the sequence's (`sampler.draw`'s prefixes): the same greedy argmax,
the same seeded noise for the same position, min_tokens counted there, penalties counting those tokens as
output, and a structured output's mask after them (`GrammarState.fill_along`; the scheduler cuts a draft
where its grammar refuses a token or ends). The draft is kept
up to its first token that differs from the draw there, and that draw is the next token. So the output is
token for token the one speculation-off gives, for greedy and seeded requests alike, and a failover resumes
it exactly. For a draft of fixed tokens, as the n-gram proposer's, this is rejection sampling: a proposed
token x is accepted with probability p(x), which is min(1, p(x) / q(x)) for q(x) = 1, and where it is
rejected the token drawn follows p without x.

A draft costs a step its tokens whether they are kept or not, so a sequence whose drafts keep failing stops
proposing for a while (`Drafting`): after a draft that gained nothing it pauses for a number of steps that
doubles with each such failure, up to MAX_PAUSE; a draft that gains a token resets it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_NGRAM = 4
MIN_NGRAM = 2  # a single repeated token proposes too much that fails
MAX_PAUSE = 32  # steps


@dataclass
class Drafting:
    """One sequence's record as a proposer's client: how long it pauses, and why."""

    pause: int = 0  # steps left without a draft
    failures: int = 0  # drafts in a row that gained nothing


class NgramProposer:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens  # --num-speculative-tokens: the longest draft

    def propose(self, tokens: list[int], drafting: Drafting, limit: int) -> tuple[int, ...]:
        """A draft of at most `limit` tokens to follow `tokens`; empty while the sequence pauses or when its
        end does not occur earlier."""
        if drafting.pause > 0:
            drafting.pause -= 1
            return ()
        limit = min(limit, self.num_tokens)
        return lookup(np.asarray(tokens), limit) if limit > 0 else ()

    @staticmethod
    def record(drafting: Drafting, accepted: int) -> None:
        """A draft was checked and `accepted` of its tokens kept."""
        if accepted:
            drafting.failures = 0
            return
        drafting.failures += 1
        drafting.pause = min(MAX_PAUSE, 1 << (drafting.failures - 1))


def lookup(tokens: np.ndarray, limit: int) -> tuple[int, ...]:
    """What followed the latest earlier occurrence of the longest suffix (MIN_NGRAM to MAX_NGRAM tokens) of
    tokens, at most `limit` tokens of it."""
    length = len(tokens)
    for n in range(min(MAX_NGRAM, length - 1), MIN_NGRAM - 1, -1):
        # Windows start at 0 .. length - 1 - n: each earlier occurrence has at least one token after it.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tuple(tokens[start : start + limit].tolist())
    return ()
