"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Each step has a budget of tokens and of sequences. Running sequences go first, best rank first (priority,
then arrival): decodes take one token, unfinished prefills take a chunk of what is left. Waiting sequences
are then admitted while budget remains; admission first looks up the prompt in the prefix cache, so cached
pages are neither recomputed nor allocated. When a sequence needs pages and the pool has none, the
worst-ranked running sequence that has not been scheduled yet is preempted: its pages go back (published
ones stay cached) and it waits to be recomputed.

Once a plan is launched, `commit` counts its KV as computed and gives each sampling sequence a placeholder
token, so the next step can be planned while the device runs this one. The scheduler never waits for the
device: when only pages that a step in flight may still write would let a sequence go on, its plan says so
(`Plan.awaits_device`), and the engine settles before it schedules again. `postprocess`, once its tokens
are back, publishes the new full pages to the prefix cache, fills the placeholders, and finishes a sequence
that meets a stop rule (`_stop_reason`): its pages go back at once, or when the steps in flight that
may write them end. With a proposer (`speculation`), a decode whose tokens are all known carries a draft of
the tokens likely to follow, run in the same step; postprocess keeps the drafted tokens the draw agrees
with, one by one through the stop rules, and gives back the pages held for the rest.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memory_daemon.lease import NULL_PAGE
from pagedserve.plumbing.errors import FailedPrecondition, StatusError
from services.worker.core.sequence import (
    PENDING,
    FinishReason,
    RequestOutput,
    Sequence,
    Status,
)
from services.worker.core.speculation import draft_all, fit_draft
from services.worker.kv.base import KVCache
from services.worker.kv.groups import group_key

if TYPE_CHECKING:
    from services.worker.core.model_runner import StepInFlight
    from services.worker.core.sampler import Samples
    from services.worker.core.speculation import Proposer


@dataclass(frozen=True)
class ScheduledSeq:
    """A sequence's share of a step."""

    seq: Sequence
    start: int  # the first new token's position
    count: int  # new tokens this step
    draft: tuple[int, ...] = ()  # proposed tokens after them, checked by this step (`speculation`)

    @property
    def width(self) -> int:
        """The tokens the step runs for it: its new ones and its draft."""
        return self.count + len(self.draft)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.width)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so the step samples its next token."""
        return self.start + self.count == self.seq.num_tokens


@dataclass(frozen=True)
class Plan:
    items: list[ScheduledSeq]
    ended: list[RequestOutput] = field(default_factory=list)  # requests ended while scheduling
    # The pool is empty, but pages freed while a step in flight may still write them would let the step go
    # on: the engine waits for the device to finish (`settle`), then schedules again.
    awaits_device: bool = False


class _PagesHeld(Exception):
    """The pool has no page, but steps in flight hold some: wait for them rather than preempt."""


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        *,
        max_batched_tokens: int,
        max_num_seqs: int,
        prefix_caching: bool = True,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int = 1 << 62,
        windows: tuple[int, ...] = (0,),
        proposer: Proposer | None = None,
    ) -> None:
        """windows: each group of the model's layers' window (services.worker.kv.groups), 0 for full
        attention; a sequence has a block table per group, and a sliding group's pages wholly before its
        window go back as the sequence runs. proposer: drafts decodes' next tokens (`speculation`)."""
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefix_caching = prefix_caching
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.windows = windows
        self.proposer = proposer
        self.requests: dict[Hashable, Sequence] = {}  # every unfinished sequence, by key
        self.running: list[Sequence] = []
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # a heap by rank
        self._compiling: list[Sequence] = []  # waiting for their grammars, in arrival order
        self.preemptions = 0
        self.launched = 0  # steps committed
        self.device_done = 0  # steps the device has finished
        self._held: list[tuple[int, list[int]]] = []  # pages freed while steps up to that one may write them
        # A request's prompt is counted when it is first admitted, with what the prefix cache held for it
        # then; a recompute after preemption is not counted again.
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        # Speculative decoding: drafts checked, their tokens, and those kept (each kept token is one that
        # a step gave beyond its one).
        self.drafts_checked = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    @property
    def num_waiting(self) -> int:
        """Sequences not running yet: queued, or waiting for their grammars."""
        return len(self._waiting) + len(self._compiling)

    def has_work(self) -> bool:
        """Whether a step would do anything: a sequence to run, or a grammar that is ready."""
        return bool(self.running or self._waiting or any(seq.grammar_ready for seq in self._compiling))

    def add(self, seq: Sequence) -> None:
        assert seq.key not in self.requests, f"request {seq.key!r} is already running"
        self.requests[seq.key] = seq
        if seq.status is Status.COMPILING:
            self._compiling.append(seq)
        else:
            self._enqueue(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence, running or waiting: its pages go back at once, pinned first if it asked and it
        ended as it should."""
        if seq.pin[0] and reason is not FinishReason.ABORT and self.prefix_caching:
            self._pin(seq)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self._waiting = [entry for entry in self._waiting if entry[1] is not seq]
            heapq.heapify(self._waiting)
        elif seq.status is Status.COMPILING:
            self._compiling.remove(seq)
            if seq.compiling is not None:  # not started yet, it never will: one compile may take a minute
                seq.compiling.cancel()
        self._release(seq)
        if seq.in_flight:  # the tokens launched after its last one
            del seq.tokens[-seq.in_flight :]
            seq.in_flight = 0
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.key]

    def commit(self, step: StepInFlight) -> None:
        """The step is launched: its KV counts as computed, and each sequence it samples for has a
        placeholder for the token it will get."""
        for item in step.items:
            item.seq.num_computed += item.count
        for seq in step.sampled:
            seq.tokens.append(PENDING)
            seq.in_flight += 1
        self.launched = step.number

    def postprocess(self, step: StepInFlight, samples: Samples) -> list[RequestOutput]:
        """The bookkeeping after a committed step is done: it sampled one token for each of its sampled
        sequences, in order, and scored the prompt positions it was asked to."""
        for item, epoch in zip(step.items, step.epochs, strict=True):
            if item.seq.epoch == epoch and item.seq.status is Status.RUNNING:
                self.publish_full_pages(item.seq, item.start + item.count)
                self._drop_out_of_reach(item.seq, item.start + item.count)
        for seq, logprob in step.scored:
            seq.prompt_logprobs.append(logprob)
        outputs = []
        for seq, first, draft in zip(step.sampled, step.first_rows, step.drafts, strict=True):
            if seq.status is Status.FINISHED:  # aborted, or stopped by a token of the step before
                continue
            if first in samples.dead_ends or (
                seq.grammar is not None and not seq.grammar.accept(samples.token_ids[first])
            ):
                self.finish(seq, FinishReason.ABORT)  # the token is meaningless: it goes with its placeholder
                outputs.append(RequestOutput.of(seq, error=dead_end(seq)))
                continue
            outputs.append(self._take_tokens(seq, draft, samples, first))
        self.device_finished(step.number)
        return outputs

    def _take_tokens(
        self, seq: Sequence, draft: tuple[int, ...], samples: Samples, first: int
    ) -> RequestOutput:
        """Take a sequence's tokens from its rows of the draw, which start at `first`: its placeholder's,
        then, while each drawn token is the draft's there, the next one's (whose input KV the step
        computed), one by one through the stop rules."""
        tokens, logprobs = [], []
        for offset in range(len(draft) + 1):
            token, token_logprob = samples.token_ids[first + offset], samples.logprobs[first + offset]
            if offset == 0:
                seq.tokens[seq.num_known] = token
                seq.in_flight -= 1
            elif first + offset in samples.dead_ends or (
                seq.grammar is not None and not seq.grammar.accept(token)
            ):
                break  # the draft ended its grammar: the next step finds the dead end itself
            else:  # the draft's token before it was right: its KV counts
                seq.num_computed += 1
                seq.tokens.append(token)
                self.publish_full_pages(seq, seq.num_computed)
            tokens.append(token)
            if token_logprob is not None:
                logprobs.append(token_logprob)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                break
            if offset == len(draft) or token != draft[offset]:
                break
        if draft:
            self.drafts_checked += 1
            self.draft_tokens += len(draft)
            self.accepted_tokens += len(tokens) - 1
            seq.drafting.record(len(tokens) - 1)
            if seq.status is Status.RUNNING:  # the pages held for the draft's rejected tokens go back
                self._free(seq.trim_pages(-(-seq.num_tokens // self.kv.page_size)))
        return RequestOutput.of(seq, tokens, logprobs)

    def device_finished(self, number: int) -> None:
        """The device is done with the steps up to `number`: pages held for them go back."""
        self.device_done = max(self.device_done, number)
        ready = [pages for step, pages in self._held if step <= self.device_done]
        self._held = [entry for entry in self._held if entry[0] > self.device_done]
        for pages in ready:
            self.kv.free(pages)

    def schedule(self) -> Plan:
        """What runs in the next step; with `awaits_device`, nothing yet: settle, then schedule again."""
        ended = self._take_compiled()
        budget = self.max_batched_tokens
        scheduled: list[ScheduledSeq] = []
        try:
            budget = self._schedule_running(scheduled, ended, budget)
        except _PagesHeld:
            return Plan([], ended, awaits_device=True)
        self._admit(scheduled, budget)
        return Plan(scheduled, ended)

    def _take_compiled(self) -> list[RequestOutput]:
        """Queue the sequences whose grammars are compiled; end those whose grammars failed."""
        ended = []
        for seq in [seq for seq in self._compiling if seq.grammar_ready]:
            try:
                seq.take_grammar()
            except StatusError as refusal:
                self.finish(seq, FinishReason.ABORT)
                ended.append(RequestOutput.of(seq, error=refusal))
                continue
            self._compiling.remove(seq)
            self._enqueue(seq)
        return ended

    def _schedule_running(
        self, scheduled: list[ScheduledSeq], ended: list[RequestOutput], budget: int
    ) -> int:
        """Schedule the running sequences, best rank first; returns the budget left."""
        ranked = sorted(self.running, key=lambda s: s.rank)
        drafts = {} if self.proposer is None else draft_all(self.proposer, ranked, self.max_model_len)
        for seq in ranked:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or self._ends_in_flight(seq):
                continue  # preempted for a better sequence this step, or its last token is on its way
            count = min(seq.num_tokens - seq.num_computed, budget)
            draft = fit_draft(seq, drafts.get(seq.key, ()), budget - count)
            if draft and self._reserve(seq, count + len(draft), protected=scheduled, may_preempt=False):
                scheduled.append(ScheduledSeq(seq, seq.num_computed, count, draft))
                budget -= count + len(draft)
            elif self._reserve(seq, count, protected=scheduled):
                scheduled.append(ScheduledSeq(seq, seq.num_computed, count))
                budget -= count
            elif len(self.running) == 1:
                if seq.in_flight:  # its token first: the next step finishes it
                    continue
                self.finish(seq, FinishReason.LENGTH)  # alone, and still the pool cannot hold it
                ended.append(RequestOutput.of(seq))
            else:
                self._preempt(seq)
        return budget

    def would_draft(self, seqs: list[Sequence]) -> bool:
        """Whether the proposer would draft for any of these sequences once their last tokens are known."""
        return self.proposer is not None and any(seq.speculates and seq.drafting.pause == 0 for seq in seqs)

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        """Admit waiting sequences, best rank first, while the step has room; a sample whose leader is still
        computing the prompt lets the ones behind it go first."""
        deferred = []
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._waiting[0][1]
            if seq.in_flight or self._awaits_leader(seq):  # a token on its way, or a leader
                deferred.append(heapq.heappop(self._waiting))
                continue
            if self.prefix_caching and seq.num_computed == 0 and not seq.wants_prompt_logprobs:
                self._match_prefix(seq)
            count = min(seq.num_tokens - seq.num_computed, budget)
            if not self._reserve(seq, count, protected=scheduled, may_preempt=False):
                self._release(seq)  # do not sit on cached pages while waiting
                break
            heapq.heappop(self._waiting)
            if seq.preemptions == 0:
                self.prompt_tokens += seq.prompt_len
                self.cached_prompt_tokens += seq.cached_prompt_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed, count))
            budget -= count
        for entry in deferred:
            heapq.heappush(self._waiting, entry)

    def _awaits_leader(self, seq: Sequence) -> bool:
        """Whether seq is a later sample of a prompt that its first sample is still computing, or whose pages
        are still on their way to the prefix cache: it will find them there once that is done. (No wait
        blocks the step: the sample is only passed over.)"""
        leader = self.requests.get(seq.follows) if seq.follows is not None else None
        if not self.prefix_caching or leader is None:
            return False
        published = leader.num_shared >= leader.prompt_len // self.kv.page_size
        return (
            leader.num_computed < leader.prompt_len
            or not published
            or not self.kv.delivered(leader.published_mark)
        )

    def publish_full_pages(self, seq: Sequence, computed: int) -> None:
        """Offer the full pages of the first `computed` tokens, those not offered yet, to the prefix cache:
        each group's under its own keys; only group 0's with their tokens, for the index's events."""
        full = computed // self.kv.page_size
        if self.prefix_caching and full > seq.num_shared:
            size = self.kv.page_size
            keys = seq.page_keys(full, size)[seq.num_shared :]
            parent = seq.page_keys(seq.num_shared, size)[-1] if seq.num_shared else seq.cache_root
            tokens = seq.tokens[seq.num_shared * size : full * size] if seq.announced else []
            for group, table in enumerate(seq.tables):
                self.kv.publish(
                    [group_key(key, group) for key in keys],
                    table[seq.num_shared : full],
                    parent=group_key(parent, group),
                    tokens=[] if group else tokens,
                )
            seq.num_shared = full
            seq.published_mark = self.kv.published

    def _pin(self, seq: Sequence) -> None:
        """Pin its published pages (cache_ttl_seconds), every group's, group 0's first: if the tenant's budget
        runs out, the chain's head is what stays pinned."""
        keys = seq.page_keys(seq.num_shared, self.kv.page_size)
        ttl_s, tenant = seq.pin
        self.kv.pin(
            [group_key(key, group) for group in range(len(seq.tables)) for key in keys], ttl_s, tenant
        )

    def _out_of_window(self, group: int, computed: int) -> int:
        """How many of a group's leading pages no query from position `computed` on sees."""
        window = self.windows[group]
        return max(0, computed - window + 1) // self.kv.page_size if window else 0

    def _drop_out_of_reach(self, seq: Sequence, computed: int) -> None:
        """Give back each sliding group's pages that no query from position `computed` on can see (published
        already, so a later request may still find them in the prefix cache)."""
        for group in range(len(seq.tables)):
            if self.windows[group]:
                self._free(seq.drop_pages(group, self._out_of_window(group, computed)))

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why the sequence ends with this token, its last known one; None if it goes on."""
        options = seq.options
        if token in options.stop_token_ids or (not options.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.terminated:  # ended by an EOS, even with ignore_eos
            return FinishReason.STOP
        return FinishReason.LENGTH if self._full(seq, seq.num_known) else None

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Whether the token on its way ends the sequence, whatever it is."""
        return seq.in_flight > 0 and self._full(seq, seq.num_tokens)

    def _full(self, seq: Sequence, tokens: int) -> bool:
        """Whether a sequence of this many tokens has reached max_tokens or the context's end."""
        return tokens - seq.prompt_len >= seq.options.max_tokens or tokens >= self.max_model_len

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        heapq.heappush(self._waiting, (seq.rank, seq))

    def _match_prefix(self, seq: Sequence) -> None:
        """Take the longest run of leading pages the prefix cache holds for every group: a full group's
        from the first page on, a sliding group's only those its window still sees (pages before it may be
        gone from the cache)."""
        size = self.kv.page_size
        # At least one token must be computed, to have logits to sample from.
        count = (seq.num_tokens - 1) // size
        keys = seq.page_keys(count, size)
        held: list[tuple[int, list[int]]] = [(0, []) for _ in self.windows]  # per group: (first, pages)
        while count > 0:  # each pass takes the match, or shortens it
            for group, (first, pages) in enumerate(held):
                need = self._out_of_window(group, count * size)
                if first <= need and first + len(pages) >= count:  # what it holds covers the need
                    self.kv.free(pages[: need - first] + pages[count - first :])
                    held[group] = (need, pages[need - first : count - first])
                else:
                    self.kv.free(pages)
                    held[group] = (need, self.kv.lookup([group_key(key, group) for key in keys[need:count]]))
            # Each group holds its pages from `first` to first + len(pages): the shortest end is the most
            # every group may serve (the next pass checks each group's window at it).
            reach = min(first + len(pages) for first, pages in held)
            if reach == count:
                break
            count = reach
        if count > 0:
            seq.tables = [[NULL_PAGE] * first + pages for first, pages in held]
            seq.dropped = [first for first, _ in held]
        else:
            self.kv.free([page for _, pages in held for page in pages])
        seq.num_shared = count
        seq.num_computed = count * size
        if seq.preemptions == 0:
            seq.cached_prompt_tokens = min(seq.num_computed, seq.prompt_len)

    def _reserve(
        self, seq: Sequence, count: int, *, protected: list[ScheduledSeq], may_preempt: bool = True
    ) -> bool:
        """Hold enough pages for `count` more tokens, preempting worse running sequences if allowed."""
        need = -(-(seq.num_computed + count) // self.kv.page_size) - seq.num_pages
        groups = len(self.windows)
        while need > 0:
            pages = self.kv.allocate(need * groups)
            if pages is not None:
                seq.add_pages(pages, groups)
                return True
            if self._held and may_preempt:
                raise _PagesHeld
            victim = self._victim(seq, protected) if may_preempt else None
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _victim(self, seq: Sequence, protected: list[ScheduledSeq]) -> Sequence | None:
        busy = {id(item.seq) for item in protected}
        candidates = [s for s in self.running if s is not seq and id(s) not in busy and s.rank > seq.rank]
        return max(candidates, key=lambda s: s.rank, default=None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self._enqueue(seq)

    def _release(self, seq: Sequence) -> None:
        self._free(seq.held_pages)
        if self.proposer is not None:
            self.proposer.release(seq)
        seq.reset()

    def _free(self, pages: list[int]) -> None:
        if not pages:
            return
        if self.device_done < self.launched:  # a step in flight may still read or write them
            self._held.append((self.launched, pages))
        else:
            self.kv.free(pages)


def dead_end(seq: Sequence) -> FailedPrecondition:
    """Why a constrained sequence cannot go on: its grammar allows no token (min_tokens may hold its end)."""
    out = seq.num_known - seq.prompt_len
    why = "its structured output allows no token of this model"
    if out < seq.options.min_tokens:
        why = f"min_tokens ({seq.options.min_tokens}) holds back the only end its structured output allows"
    return FailedPrecondition(f"the request stopped after {out} tokens: {why}")
