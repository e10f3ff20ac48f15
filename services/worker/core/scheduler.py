"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Each step has a budget of tokens and of sequences. Running sequences go first, best rank first (priority,
then arrival): decodes take one token, unfinished prefills take a chunk of what is left. Waiting sequences
are then admitted while budget remains; admission first looks up the prompt in the prefix cache, so cached
pages are neither recomputed nor allocated. When a sequence needs pages and the pool has none, the
worst-ranked running sequence that has not been scheduled yet is preempted: its pages go back (published
ones stay cached) and it waits to be recomputed.

Once a plan is launched, `commit` counts its KV as computed and gives each sampling sequence a placeholder
token, so the next step can be planned while the device runs this one. `postprocess`, once its tokens are
back, publishes the new full pages to the prefix cache, fills the placeholders, and finishes a sequence that
meets a stop rule (`stops`): its pages go back at once, or when the steps in flight that may write them end.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable
from collections.abc import Sequence as Seq

from memory_daemon.prefix import ROOT_KEY
from services.worker.core.outputs import RequestOutput
from services.worker.core.plan import Launch, Plan, ScheduledSeq
from services.worker.core.sampler import Samples
from services.worker.core.sequence import PENDING, FinishReason, Sequence, Status, TokenLogprob
from services.worker.core.stops import StopRules, dead_end
from services.worker.kv.base import KVCache


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
    ) -> None:
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefix_caching = prefix_caching
        self.stops = StopRules(frozenset(eos_token_ids), max_model_len)
        self.requests: dict[Hashable, Sequence] = {}  # every unfinished sequence, by key
        self.running: list[Sequence] = []
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # a heap by rank
        self.preemptions = 0
        self.launched = 0  # steps committed
        self.device_done = 0  # steps the device has finished
        self.wait_for_device: Callable[[], None] = lambda: None  # until every committed step is finished
        self._held: list[tuple[int, list[int]]] = []  # pages freed while steps up to that one may write them
        # A request's prompt is counted when it is first admitted, with what the prefix cache held for it
        # then; a recompute after preemption is not counted again.
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(self, seq: Sequence) -> None:
        assert seq.key not in self.requests, f"request {seq.key!r} is already running"
        self.requests[seq.key] = seq
        self._enqueue(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence, running or waiting: its pages go back at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self._waiting = [entry for entry in self._waiting if entry[1] is not seq]
            heapq.heapify(self._waiting)
        self._release(seq)
        if seq.in_flight:  # the tokens launched after its last one
            del seq.tokens[-seq.in_flight :]
            seq.in_flight = 0
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.key]

    def commit(self, items: list[ScheduledSeq], sampled: list[Sequence]) -> Launch:
        """The items are launched: their KV counts as computed, and each of sampled has a placeholder for
        the token it will get."""
        epochs = [item.seq.epoch for item in items]
        for item in items:
            item.seq.num_computed += item.count
        for seq in sampled:
            seq.tokens.append(PENDING)
            seq.in_flight += 1
        self.launched += 1
        return Launch(self.launched, items, epochs, sampled)

    def postprocess(
        self,
        launched: Launch,
        samples: Samples,
        scored: Seq[tuple[Sequence, TokenLogprob]] = (),
    ) -> list[RequestOutput]:
        """The bookkeeping after a committed step is done: it sampled one token for each of its sampled
        sequences, in order; scored: the prompt log-probabilities it computed."""
        for item, epoch in zip(launched.items, launched.epochs, strict=True):
            if item.seq.epoch == epoch and item.seq.status is Status.RUNNING:
                self.publish_full_pages(item.seq, item.start + item.count)
        for seq, logprob in scored:
            seq.prompt_logprobs.append(logprob)
        outputs = []
        for row, (seq, token, token_logprob) in enumerate(
            zip(launched.sampled, samples.token_ids, samples.logprobs, strict=True)
        ):
            if seq.status is Status.FINISHED:  # aborted, or stopped by a token of the step before
                continue
            if row in samples.dead_ends or (seq.grammar is not None and not seq.grammar.accept(token)):
                self.finish(seq, FinishReason.ABORT)  # the token is meaningless: it goes with its placeholder
                outputs.append(RequestOutput.of(seq, error=dead_end(seq)))
                continue
            seq.tokens[seq.num_known] = token
            seq.in_flight -= 1
            reason = self.stops.reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
            outputs.append(
                RequestOutput.of(seq, [token], [token_logprob] if token_logprob is not None else [])
            )
        self.device_finished(launched.number)
        return outputs

    def device_finished(self, number: int) -> None:
        """The device is done with the steps up to `number`: pages held for them go back."""
        self.device_done = max(self.device_done, number)
        ready = [pages for step, pages in self._held if step <= self.device_done]
        self._held = [entry for entry in self._held if entry[0] > self.device_done]
        for pages in ready:
            self.kv.free(pages)

    def settle(self) -> None:
        """Wait for every committed step, and take back the pages held for them."""
        self.wait_for_device()
        self.device_finished(self.launched)

    def schedule(self) -> Plan:
        budget = self.max_batched_tokens
        scheduled: list[ScheduledSeq] = []
        dropped: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.rank):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or self.stops.ends_in_flight(seq):
                continue  # preempted for a better sequence this step, or its last token is on its way
            count = min(seq.num_tokens - seq.num_computed, budget)
            if self._reserve(seq, count, protected=scheduled):
                scheduled.append(ScheduledSeq(seq, seq.num_computed, count))
                budget -= count
            elif len(self.running) == 1:
                if seq.in_flight:  # its token first: the next step finishes it
                    continue
                self.finish(seq, FinishReason.LENGTH)  # alone, and still the pool cannot hold it
                dropped.append(seq)
            else:
                self._preempt(seq)
        self._admit(scheduled, budget)
        return Plan(scheduled, dropped)

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
        """Offer the full pages of the first `computed` tokens, those not offered yet, to the prefix cache."""
        full = computed // self.kv.page_size
        if self.prefix_caching and full > seq.num_shared:
            size = self.kv.page_size
            keys = seq.page_keys(full, size)
            parent = keys[seq.num_shared - 1] if seq.num_shared else seq.cache_root
            # A salted chain's pages are not announced to gateways: only the salt's requests may find them.
            tokens = seq.tokens[seq.num_shared * size : full * size] if seq.cache_root == ROOT_KEY else []
            self.kv.publish(
                keys[seq.num_shared :], seq.pages[seq.num_shared : full], parent=parent, tokens=tokens
            )
            seq.num_shared = full
            seq.published_mark = self.kv.published

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        heapq.heappush(self._waiting, (seq.rank, seq))

    def _match_prefix(self, seq: Sequence) -> None:
        # At least one token must be computed, to have logits to sample from.
        limit = (seq.num_tokens - 1) // self.kv.page_size
        if limit == 0:
            return
        pages = self.kv.lookup(seq.page_keys(limit, self.kv.page_size))
        seq.pages = pages
        seq.num_shared = len(pages)
        seq.num_computed = len(pages) * self.kv.page_size
        if seq.preemptions == 0:
            seq.cached_prompt_tokens = min(seq.num_computed, seq.prompt_len)

    def _reserve(
        self, seq: Sequence, count: int, *, protected: list[ScheduledSeq], may_preempt: bool = True
    ) -> bool:
        """Hold enough pages for `count` more tokens, preempting worse running sequences if allowed."""
        need = -(-(seq.num_computed + count) // self.kv.page_size) - len(seq.pages)
        while need > 0:
            pages = self.kv.allocate(need)
            if pages is not None:
                seq.pages += pages
                return True
            if (
                self._held and may_preempt
            ):  # pages a step in flight may still write: wait, rather than preempt
                self.settle()
                continue
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
        if seq.pages:
            if self.device_done < self.launched:  # a step in flight may still write them
                self._held.append((self.launched, seq.pages))
            else:
                self.kv.free(seq.pages)
        seq.reset()
