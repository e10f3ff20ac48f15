"""One request inside the engine: its tokens, its place in the pool, and how far its KV is computed."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memory_daemon.prefix import ROOT_KEY, page_keys
from services.common.sampling import SamplingOptions

if TYPE_CHECKING:
    from services.worker.core.grammar import GrammarState


PENDING = -1  # a token id that is still on the device (Sequence.in_flight)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the n most likely tokens and their log-probabilities


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    key: Hashable  # the caller's handle for the request
    tokens: list[int]  # prompt, then output
    prompt_len: int
    options: SamplingOptions
    priority: int  # lower runs first
    arrival: int  # submission order, the tie-breaker
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)  # the block table
    num_computed: int = 0  # leading tokens whose KV is in the pool
    num_shared: int = 0  # leading pages that are shared: published, or found in the prefix cache
    cached_prompt_tokens: int = 0  # prompt tokens the first admission found in the prefix cache
    preemptions: int = 0
    finish_reason: FinishReason | None = None
    cache_root: bytes = ROOT_KEY  # the parent of its page-key chain: its cache salt's namespace
    grammar: GrammarState | None = None  # its structured output's matcher
    follows: Hashable | None = None  # an earlier sample of the same prompt, whose prefill it waits for
    published_mark: int = 0  # the KV cache's publish count after its latest pages (KVCache.delivered)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # for prompt tokens 1, 2, ... so far
    # Tokens sampled on the device whose ids have not reached the host: placeholders (PENDING) that end
    # `tokens`, so that the next step can be scheduled before they are known.
    in_flight: int = 0
    epoch: int = 0  # counts resets: work launched in an earlier epoch wrote pages the sequence no longer has
    _keys: list[bytes] = field(default_factory=list)  # the hash chain of leading full pages

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

    def reset(self) -> None:
        """Forget the KV (after preemption): the tokens stay and are recomputed on readmission."""
        self.pages = []
        self.num_computed = 0
        self.num_shared = 0
        self.status = Status.WAITING
        self.epoch += 1
