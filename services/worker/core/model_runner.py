"""The model runner: a step's schedule in, one sampled token per finishing chunk out.

It builds the flat batch (`batch`), runs the forward pass, by CUDA graph replay where one fits (`cuda_graphs`)
and eagerly otherwise, and samples (`sampler`), all without waiting for the device: `launch` returns the step
in flight, and its `wait` the tokens. A step launched while the one before is still in flight takes that
one's sampled tokens as inputs on the device. It owns nothing about requests' lifecycles: the scheduler's
postprocess does the bookkeeping with what `wait` returns. `wait_for_device` is the engine's alone: the
scheduler never waits for the device.
"""

from __future__ import annotations

import functools
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from services.worker.core.batch import ForwardBatch, build_batch, to_device
from services.worker.core.cuda_graphs import DecodeGraphs
from services.worker.core.grammar import fill_masks
from services.worker.core.sampler import Draw, Samples, draw, score
from services.worker.core.scheduler import ScheduledSeq
from services.worker.core.sequence import PENDING, Sequence, TokenLogprob
from services.worker.kv.base import KVCache
from services.worker.models import CausalLM

SCORE_ROWS = 256


@dataclass(frozen=True)
class StepInFlight:
    """A step launched on the device and not yet postprocessed: what ran, and its draw, which may still be
    on the device."""

    number: int  # steps launched before it, and it
    items: list[ScheduledSeq]  # in batch order
    epochs: list[int]  # each item's sequence's epoch at launch: a later reset makes its KV stale
    sampled: list[Sequence]  # the sequences that get a token, in the order of their rows in the draw
    drafts: list[tuple[int, ...]]  # each one's draft: a row more for each of its tokens
    draw: Draw
    num_tokens: int  # tokens the forward pass ran
    scored: list[tuple[Sequence, TokenLogprob]]  # prompt tokens' log-probabilities, in prompt order
    first_rows: list[int] = field(init=False)  # each sampled sequence's first row in the draw

    def __post_init__(self) -> None:
        rows = itertools.accumulate((1 + len(draft) for draft in self.drafts), initial=0)
        object.__setattr__(self, "first_rows", list(rows)[:-1])

    @property
    def needs_host(self) -> bool:
        """Whether the next step must wait for this one's tokens on the host before it is scheduled: a
        grammar, a penalty or a prompt's log-probabilities read them, or a draft makes their count unknown."""
        return (
            any(
                seq.grammar is not None or seq.options.penalized or seq.wants_prompt_logprobs
                for seq in self.sampled
            )
            or bool(self.scored)
            or any(self.drafts)
        )

    def wait(self) -> Samples:
        return self.draw.samples()


def _score_prompts(
    logits: torch.Tensor, positions: list[tuple[Sequence, int]]
) -> list[tuple[Sequence, TokenLogprob]]:
    """The scored prompt positions' log-probabilities, some rows at a time: a row is vocabulary-wide."""
    results: list[tuple[Sequence, TokenLogprob]] = []
    for start in range(0, len(positions), SCORE_ROWS):
        part = positions[start : start + SCORE_ROWS]
        tops = [seq.options.prompt_logprobs or 0 for seq, _ in part]
        scores = score(logits[start : start + SCORE_ROWS], [token for _, token in part], tops)
        results += [(seq, logprob) for (seq, _), logprob in zip(part, scores, strict=True)]
    return results


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv: KVCache, graphs: DecodeGraphs | None = None, overlap_masks: bool = False
    ) -> None:
        self.model = model
        self.kv = kv
        self.graphs = graphs
        self._eos = frozenset(model.spec.eos_token_ids)
        # Grammar masks filled on a thread of their own while the model runs (xgrammar frees the GIL).
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar") if overlap_masks else None

    def launch(
        self, items: list[ScheduledSeq], number: int, previous: StepInFlight | None = None
    ) -> StepInFlight:
        """Run step `number` on the device; previous: the step before, if its tokens are not on the host
        yet."""
        batch = build_batch(items, self.kv.page_size, self.model.device)
        if previous is not None:
            _take_pending_tokens(batch, previous)
        sampled = [item.seq for item in batch.sampling]
        drafts = [item.draft for item in batch.sampling]
        # A row for each token drawn: each sampled sequence's, then one after each token of its draft.
        rows = sampled
        prefixes = None
        if any(drafts):
            rows = [item.seq for item in batch.sampling for _ in range(1 + len(item.draft))]
            prefixes = [
                item.draft[:offset] for item in batch.sampling for offset in range(1 + len(item.draft))
            ]
        states = [seq.grammar for seq in sampled]
        fill = functools.partial(fill_masks, states, self.model.spec.vocab_size, drafts)
        grammars = any(state is not None for state in states)
        filling = self._masker.submit(fill) if self._masker is not None and grammars else None
        logits = self.graphs.run(batch) if self.graphs is not None and not batch.scored else None
        if logits is None:  # a prefill, a batch larger than any graph, or no graphs
            logits = self.model.forward(
                batch.input_ids, batch.positions, batch.metas, self.kv.kv, batch.logits_indices
            )
        masks = filling.result() if filling is not None else fill() if grammars else None
        return StepInFlight(
            number,
            batch.items,
            [item.seq.epoch for item in batch.items],
            sampled,
            drafts,
            draw(logits[: len(rows)], rows, self._eos, masks, prefixes),
            batch.num_tokens,
            _score_prompts(logits[len(rows) :], batch.scored),
        )

    def wait_for_device(self) -> None:
        """Block until the device has run everything launched."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def rebind(self, kv: KVCache) -> None:
        """Run on another pool (the daemon came back): the graphs baked in the old pool's address."""
        self.kv = kv
        if self.graphs is not None:
            self.graphs.kv = kv.kv
            self.graphs.capture()


def _take_pending_tokens(batch: ForwardBatch, previous: StepInFlight) -> None:
    """Fill the batch's pending input tokens, on the device, from the previous step's draw: a decode's
    whose token that step sampled."""
    rows = {id(seq): row for seq, row in zip(previous.sampled, previous.first_rows, strict=True)}
    pending = [
        (first, rows[id(item.seq)])
        for item, first in zip(batch.items, batch.firsts, strict=True)
        if item.seq.tokens[item.start] == PENDING
    ]
    if pending:
        into, taken = zip(*pending, strict=True)
        ids = batch.input_ids
        ids[to_device(list(into), torch.long, ids)] = previous.draw.tokens[
            to_device(list(taken), torch.long, ids)
        ]
