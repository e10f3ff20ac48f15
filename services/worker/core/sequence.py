"""One request inside the engine: its tokens, its place in the pool, how far its KV is computed, and what each
step hands back for it (`RequestOutput`)."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memory_daemon.lease import NULL_PAGE
from memory_daemon.prefix import ROOT_KEY, page_keys, salted_root
from pagedserve.plumbing.errors import InvalidArgument, StatusError
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.speculation import Drafting

if TYPE_CHECKING:
    from services.worker.core.grammar import GrammarState


PENDING = -1  # a token id that is still on the device (Sequence.in_flight)


class Status(enum.Enum):
    COMPILING = "compiling"  # its structured output's grammar is compiling: it waits for no pages yet
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the n most likely tokens and their log-probabilities


class Sequence:
    def __init__(
        self,
        key: Hashable,
        request: EngineRequest,
        arrival: int,
        follows: Hashable | None = None,
        grammar: Future[GrammarState] | None = None,
    ) -> None:
        """key: the caller's handle for the request; arrival: submission order, the tie-breaker; follows: the
        key of an earlier sample of the same prompt, whose prefill it waits for; grammar: its structured
        output's matcher, compiling, which it waits for (COMPILING) before it is scheduled."""
        self.key = key
        self.tokens = [*request.prompt_ids, *request.generated]  # prompt, then output
        self.prompt_len = len(request.prompt_ids)
        self.options: SamplingOptions = request.options
        self.priority = request.priority  # lower runs first
        self.arrival = arrival
        self.cache_root = salted_root(request.cache_salt)  # the parent of its page-key chain
        self.pin = (request.cache_ttl_seconds, request.tenant)  # pin its pages when it ends (TTL 0: no)
        self.follows = follows
        self.compiling = grammar  # until its grammar is taken (`take_grammar`)
        self.grammar: GrammarState | None = None  # its structured output's matcher, once compiled
        self.status = Status.COMPILING if grammar is not None else Status.WAITING
        # A block table per group of layers (services.worker.kv.groups), all of one length; empty until it
        # holds pages.
        self.tables: list[list[int]] = []
        self.dropped: list[int] = []  # per group: leading pages given back, out of its window (the null page)
        self.num_computed = 0  # leading tokens whose KV is in the pool
        self.num_shared = 0  # leading pages that are shared: published, or found in the prefix cache
        self.cached_prompt_tokens = 0  # prompt tokens the first admission found in the prefix cache
        self.preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.published_mark = 0  # the KV cache's publish count after its latest pages (KVCache.delivered)
        self.prompt_logprobs: list[TokenLogprob] = []  # for prompt tokens 1, 2, ... so far
        # Tokens sampled on the device whose ids have not reached the host: placeholders (PENDING) that end
        # `tokens`, so that the next step can be scheduled before they are known.
        self.in_flight = 0
        self.epoch = 0  # counts resets: work launched in an earlier epoch wrote pages it no longer has
        self.drafting = Drafting()  # its record with the speculative proposer
        self._keys: list[bytes] = []  # the hash chain of leading full pages

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has: all but those in flight."""
        return len(self.tokens) - self.in_flight

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether it still has prompt positions to score (and so computes its prompt whole)."""
        return self.options.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def rank(self) -> tuple[int, int]:
        """Scheduling order: smaller runs first and is preempted last."""
        return (self.priority, self.arrival)

    def page_keys(self, count: int, page_size: int) -> list[bytes]:
        """The chain keys of the first `count` full pages, extending the cached chain as needed."""
        if count > len(self._keys):
            start = len(self._keys) * page_size
            parent = self._keys[-1] if self._keys else self.cache_root
            self._keys += page_keys(self.tokens[start : count * page_size], page_size, parent)
        return self._keys[:count]

    @property
    def pages(self) -> list[int]:
        """Group 0's block table: a one-group model's only one."""
        return self.tables[0] if self.tables else []

    @property
    def num_pages(self) -> int:
        """The length of each of its block tables."""
        return len(self.pages)

    @property
    def held_pages(self) -> list[int]:
        """The pages it holds: its block tables but for the pages it dropped."""
        return [
            page for table, dropped in zip(self.tables, self.dropped, strict=True) for page in table[dropped:]
        ]

    def add_pages(self, pages: list[int], groups: int) -> None:
        """Extend each of its `groups` block tables by an equal share of `pages`, in group order."""
        if not self.tables:
            self.tables, self.dropped = [[] for _ in range(groups)], [0] * groups
        share = len(pages) // groups
        for group, table in enumerate(self.tables):
            table += pages[group * share : (group + 1) * share]

    def drop_pages(self, group: int, count: int) -> list[int]:
        """Give up the first `count` pages of a group's table (those not dropped yet), leaving the null page
        in their place; returns the pages given up."""
        table, first = self.tables[group], self.dropped[group]
        dropped = table[first:count]
        table[first:count] = [NULL_PAGE] * len(dropped)
        self.dropped[group] = max(first, count)
        return dropped

    def trim_pages(self, count: int) -> list[int]:
        """Shorten each of its block tables to `count` pages; returns the pages given up."""
        trimmed = [page for table in self.tables for page in table[count:]]
        for table in self.tables:
            del table[count:]
        return trimmed

    @property
    def speculates(self) -> bool:
        """Whether a proposer may draft for it: it did not turn speculation off, and its grammar, if any, is
        compiled."""
        return self.options.speculative and self.compiling is None

    def reset(self) -> None:
        """Forget the KV (after preemption): the tokens stay and are recomputed on readmission."""
        self.tables = []
        self.dropped = []
        self.num_computed = 0
        self.num_shared = 0
        self.status = Status.WAITING
        self.epoch += 1

    @property
    def grammar_ready(self) -> bool:
        """Whether the grammar it waits for, if any, has compiled (or failed to)."""
        return self.compiling is None or self.compiling.done()

    def take_grammar(self) -> None:
        """Take its compiled grammar, past the tokens it generated already; raises the refusal (StatusError)
        of a grammar that does not compile, or that those tokens do not follow."""
        if self.compiling is None:
            return
        compiling, self.compiling = self.compiling, None
        self.grammar = compiling.result()
        if not all(self.grammar.accept(token) for token in self.output_ids):
            raise InvalidArgument("the generated tokens do not follow sampling.structured")

    @property
    def announced(self) -> bool:
        """Whether its pages are announced to gateways: a salted chain's are not, so that only the salt's
        requests may find them."""
        return self.cache_root == ROOT_KEY


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
