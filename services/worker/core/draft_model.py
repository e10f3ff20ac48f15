"""Speculative decoding's draft model (`--speculative draft --draft-model DIR`): a smaller model of the
target's tokenizer proposes each decode's next tokens, its greedy choices, which the target's step checks
(`speculation`).

For each sequence it drafts for it keeps a shadow: a `Sequence` of its own that holds the sequence's tokens,
then its latest draft's, and a block table in its own KV pool (a lease of its own on the daemon's pool for
its shape, or an in-process pool). A step's drafting is one batched forward pass per drafted token: the first
catches each shadow up with its sequence (the tokens the last check kept, or a new sequence's whole prompt,
in chunks within the token budget) and proposes a token; each later pass proposes the next one. The KV a
shadow computed for its draft's tokens stays valid up to the first token the check did not keep.

A draft model's passes cost time, as much as a target's step where the two are alike in size, so a draft
that is right can still lose: a step that gives 4.5 tokens for the price of five plain ones. So the proposer
also weighs time (`Payoff`): it measures the tokens a sequence gains a second in steps with drafts and in
steps without, and drafts only while drafting is the faster, trying the other way now and then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.batch import build_batch
from services.worker.core.scheduler import ScheduledSeq
from services.worker.core.sequence import Sequence
from services.worker.kv.base import KVCache
from services.worker.models import CausalLM

PROBE_EVERY = 16  # steps: one step the other way, to measure it again
MAX_PROBE_EVERY = 256
SMOOTHING = 0.3  # the weight of a step's rate in its way's running mean


@dataclass
class _Shadow:
    seq: Sequence  # the draft model's: its tokens (the sequence's, then its draft's) and its pages
    kept: int  # its leading tokens that are the sequence's own (the rest are its draft's)


class Payoff:
    """Whether drafting pays: the tokens a sequence gains a second in steps with drafts, against steps
    without, each a running mean of measured steps. Unmeasured, a way is tried; then the faster one is
    taken, and the other tried for one step after PROBE_EVERY steps, then after twice as many each time a
    try does not change the choice (up to MAX_PROBE_EVERY), so that a way far behind costs little."""

    def __init__(self) -> None:
        self.rates: dict[bool, float] = {}  # drafted -> tokens a sequence a second
        self.probe_every = PROBE_EVERY
        self._since_probe = 0
        self._probing = False  # the step being measured tried the slower way

    def measured(self, drafted: bool, tokens_per_seq: float, seconds: float) -> None:
        before = self._best()
        rate = tokens_per_seq / max(seconds, 1e-9)
        old = self.rates.get(drafted)
        self.rates[drafted] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        if self._probing:
            self._probing = False
            changed = self._best() != before
            self.probe_every = PROBE_EVERY if changed else min(2 * self.probe_every, MAX_PROBE_EVERY)

    def drafts(self) -> bool:
        """Whether the next step drafts."""
        for way in (True, False):
            if way not in self.rates:
                return way
        best = self.rates[True] >= self.rates[False]
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            self._probing = True
            return not best
        return best

    def _best(self) -> bool | None:
        if len(self.rates) < 2:
            return None
        return self.rates[True] >= self.rates[False]


class DraftModelProposer:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        num_tokens: int,
        max_batched_tokens: int,
        vocab_size: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """vocab_size: the target's; a draft model's logits beyond it (padding) are never proposed.
        max_batched_tokens: the most tokens one pass catches up. clock: seconds, for `Payoff`."""
        self.model = model
        self.kv = kv
        self.num_tokens = num_tokens
        self.max_batched_tokens = max_batched_tokens
        self.vocab_size = vocab_size
        self._groups = model.spec.kv_groups.count
        self._shadows: dict[Hashable, _Shadow] = {}
        self.payoff = Payoff()
        self._clock = clock
        self._last: tuple[float, bool] | None = None  # when the last call began, and whether it drafted
        self._seen: dict[Hashable, int] = {}  # each sequence's length at the last call, if it was asked then

    def propose(self, requests: Seq[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        now = self._clock()
        # What the step since the last call gave each sequence asked for then and now.
        gains = [seq.num_tokens - self._seen[seq.key] for seq, _ in requests if seq.key in self._seen]
        self._seen = {seq.key: seq.num_tokens for seq, _ in requests}
        if self._last is not None and gains:
            self.payoff.measured(self._last[1], sum(gains) / len(gains), now - self._last[0])
        drafting = self.payoff.drafts()
        self._last = (now, drafting)
        if not drafting:
            return [() for _ in requests]
        return self._draft(requests)

    def _draft(self, requests: Seq[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        drafts: dict[Hashable, list[int]] = {seq.key: [] for seq, _ in requests}
        limits: dict[Hashable, int] = {}
        items: list[ScheduledSeq] = []
        budget = self.max_batched_tokens
        for seq, limit in requests:
            # Positions up to the draft's last token's but one are written: they must fit the draft model.
            limit = min(limit, self.num_tokens, self.model.spec.max_model_len - seq.num_tokens + 1)
            shadow = self._shadow(seq).seq
            count = min(shadow.num_tokens - shadow.num_computed, budget)
            whole = count == shadow.num_tokens - shadow.num_computed  # so this pass proposes
            reach = shadow.num_computed + count + (limit - 1 if whole else 0)
            if limit > 0 and count > 0 and self._reserve(shadow, reach):
                items.append(ScheduledSeq(shadow, shadow.num_computed, count))
                limits[seq.key] = limit
                budget -= count
        while items:
            following = []
            for item, token in self._run(items):
                shadow = item.seq
                shadow.num_computed = item.start + item.count
                if token is None:
                    continue  # a prompt's chunk: the rest of it next step
                shadow.tokens.append(token)
                draft = drafts[shadow.key]
                draft.append(token)
                if len(draft) < limits[shadow.key]:
                    following.append(ScheduledSeq(shadow, shadow.num_tokens - 1, 1))
            items = following
        return [tuple(drafts[seq.key]) for seq, _ in requests]

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.key, None)
        if shadow is not None:
            self.kv.free(shadow.seq.held_pages)

    def rebind(self, kv: KVCache) -> None:
        """Run on another pool (the daemon came back); every sequence is gone, and what drafting pays is
        measured anew."""
        self._shadows.clear()
        self._seen.clear()
        self._last = None
        self.payoff = Payoff()
        self.kv = kv

    def _shadow(self, seq: Sequence) -> _Shadow:
        """The sequence's shadow, its tokens made the sequence's: its draft's are kept up to the first one
        that differs, with their KV."""
        shadow = self._shadows.get(seq.key)
        if shadow is None:
            request = EngineRequest(tuple(seq.tokens), SamplingOptions())
            shadow = _Shadow(Sequence(seq.key, request, 0), seq.num_tokens)
            self._shadows[seq.key] = shadow
            return shadow
        tokens, same = shadow.seq.tokens, shadow.kept
        end = min(len(tokens), seq.num_tokens)
        while same < end and tokens[same] == seq.tokens[same]:
            same += 1
        del tokens[same:]
        tokens += seq.tokens[same:]
        # Its last token runs again even where its KV is there: its logits propose the draft's first token.
        shadow.seq.num_computed = min(shadow.seq.num_computed, same, seq.num_tokens - 1)
        shadow.kept = seq.num_tokens
        return shadow

    def _reserve(self, shadow: Sequence, tokens: int) -> bool:
        """Pages for the shadow's first `tokens` positions; False if the pool has none to spare."""
        pages = (-(-tokens // self.kv.page_size) - shadow.num_pages) * self._groups
        if pages <= 0:
            return True
        taken = self.kv.allocate(pages) if pages < self.kv.num_pages else None
        if taken is None:
            return False
        shadow.add_pages(taken, self._groups)
        return True

    def _run(self, items: list[ScheduledSeq]) -> list[tuple[ScheduledSeq, int | None]]:
        """One forward pass of the draft model: each item's greedy next token, None for a chunk that does
        not reach its shadow's end."""
        batch = build_batch(items, self.kv.page_size, self.model.device)
        logits = self.model.forward(
            batch.input_ids, batch.positions, batch.metas, self.kv.kv, batch.logits_indices
        )
        tokens = iter(logits[: len(batch.sampling), : self.vocab_size].argmax(dim=-1).tolist())
        return [(item, next(tokens) if item.samples else None) for item in batch.items]
