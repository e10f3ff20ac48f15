"""Speculative decoding: tokens a sequence will likely produce next (a draft), checked by the model in the
sequence's next step, which then gives up to the draft's length plus one token instead of one.

Two proposers (`Proposer`) make drafts:
- `--speculative ngram` is prompt lookup: the sequence's last n tokens (n from MAX_NGRAM down to MIN_NGRAM)
  are looked up in its earlier tokens, prompt and output, and what followed their latest earlier occurrence
  is the draft. It needs no model, and it wins where the output copies its input (edits, quotes,
  extraction).
- `--speculative draft --draft-model DIR` runs a smaller model of the same tokenizer greedily
  (`draft_model.DraftModelProposer`), on KV pages of its own.

How a draft is checked (the scheduler's `_take_tokens`): the step runs the sequence's last token and the
draft as one chunk, and draws a token at each of its positions exactly as a step without speculation would
once the draft's tokens before it were the sequence's (`sampler.draw`'s prefixes): the same greedy argmax,
the same seeded noise for the same position, min_tokens counted there, penalties counting those tokens as
output, and a structured output's mask after them (`GrammarState.fill_along`; the scheduler cuts a draft
where its grammar refuses a token or ends). The draft is kept up to its first token that differs from the
draw there, and that draw is the next token. So the output is
token for token the one speculation-off gives, for greedy and seeded requests alike, and a failover resumes
it exactly. Both proposers' drafts are functions of the sequence's tokens (the draft model's is its greedy
choice), so this is rejection sampling: a proposed
token x is accepted with probability p(x), which is min(1, p(x) / q(x)) for q(x) = 1, and where it is
rejected the token drawn follows p without x.

A draft costs a step its tokens whether they are kept or not, so a sequence whose drafts keep failing stops
proposing for a while (`Drafting`): after a draft that gained nothing it pauses for a number of steps that
doubles with each such failure, up to MAX_PAUSE; a draft that gains a token resets it.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_NGRAM = 4
MIN_NGRAM = 2  # a single repeated token proposes too much that fails
MAX_PAUSE = 32  # steps

if TYPE_CHECKING:
    from services.worker.core.sequence import Sequence


@dataclass
class Drafting:
    """One sequence's record as a proposer's client: how long it pauses, and why."""

    pause: int = 0  # steps left without a draft
    failures: int = 0  # drafts in a row that gained nothing

    def waits(self) -> bool:
        """Whether it sits this step out (counting the step off its pause)."""
        if self.pause > 0:
            self.pause -= 1
            return True
        return False

    def record(self, accepted: int) -> None:
        """A draft was checked and `accepted` of its tokens kept."""
        if accepted:
            self.failures = 0
            return
        self.failures += 1
        self.pause = min(MAX_PAUSE, 1 << (self.failures - 1))


class Proposer(Protocol):
    num_tokens: int  # --num-speculative-tokens: the longest draft

    def propose(self, requests: Seq[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        """A draft for each (sequence, most tokens) to follow its tokens, all of which are known; empty
        where it has none."""
        ...

    def release(self, seq: Sequence) -> None:
        """The sequence let go of its pages (finished, or preempted): so does what the proposer keeps for
        it."""
        ...


class NgramProposer:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def propose(self, requests: Seq[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        return [
            lookup(np.asarray(seq.tokens), min(limit, self.num_tokens)) if limit > 0 else ()
            for seq, limit in requests
        ]

    def release(self, seq: Sequence) -> None:
        pass  # it keeps nothing


def draft_all(
    proposer: Proposer, ranked: list[Sequence], max_model_len: int
) -> dict[Hashable, tuple[int, ...]]:
    """The proposer's drafts, by key, for the decodes whose tokens are all known and that do not pause; none
    reaches past the request's max_tokens or the context (the step gives at most one token more than its
    draft)."""
    requests = []
    for seq in ranked:
        if seq.in_flight or seq.num_tokens - seq.num_computed != 1 or not seq.speculates:
            continue
        if seq.drafting.waits():
            continue
        left = min(seq.prompt_len + seq.options.max_tokens, max_model_len) - seq.num_tokens
        requests.append((seq, left - 1))
    drafts = proposer.propose(requests) if requests else []
    return {seq.key: draft for (seq, _), draft in zip(requests, drafts, strict=True) if draft}


def fit_draft(seq: Sequence, draft: tuple[int, ...], room: int) -> tuple[int, ...]:
    """The draft cut to `room` tokens of the step's budget, and to what the sequence's grammar allows (each
    drafted row is masked after the draft's tokens before it)."""
    draft = draft[: max(room, 0)]
    if draft and seq.grammar is not None:
        draft = draft[: seq.grammar.allows(draft)]
    return draft


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
