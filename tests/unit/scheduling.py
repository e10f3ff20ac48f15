"""For the scheduler's tests: a tiny in-process pool (4 tokens a page, refills of exactly one page), so
that page counts are exact, and a fake model step. `step` stands in for the model only: it samples one fake
token for every chunk that samples, and hands them to the scheduler's own postprocess, as the engine core
does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memory_daemon.refill import RefillSettings
from memory_daemon.shape import PoolShape
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.model_runner import StepInFlight
from services.worker.core.sampler import Draw, Samples
from services.worker.core.scheduler import ScheduledSeq, Scheduler
from services.worker.core.sequence import FinishReason, Sequence
from services.worker.kv.local import LocalKVCache

PAGE_SIZE = 4
SHAPE = PoolShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", page_size=PAGE_SIZE)
FAKE_TOKEN = 1000  # sampled tokens are FAKE_TOKEN + their position: never a prompt token here

Item = tuple[str, int, int, bool]  # (key, start, count, samples) of one scheduled chunk


@dataclass(frozen=True)
class Step:
    items: list[Item]  # what the schedule ran, in order
    dropped: list[str]  # plan.ended: ended by the scheduler, the pool cannot hold them alone
    done: list[str]  # finished after sampling, at their max_tokens


def make_kv(usable_pages: int) -> LocalKVCache:
    """A pool of `usable_pages` pages (plus the null page) that leases one page at a time."""
    return LocalKVCache(SHAPE, usable_pages + 1, refill=RefillSettings(min_pages=1, max_pages=1))


def make_scheduler(
    kv: LocalKVCache,
    *,
    max_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    prefix_caching: bool = True,
    windows: tuple[int, ...] = (0,),
) -> Scheduler:
    return Scheduler(
        kv,
        max_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        prefix_caching=prefix_caching,
        windows=windows,
    )


def prompt(length: int, first: int = 0) -> list[int]:
    return list(range(first, first + length))


def make_seq(
    key: str, tokens: list[int], *, max_tokens: int, priority: int = 0, arrival: int = 0
) -> Sequence:
    request = EngineRequest(tuple(tokens), SamplingOptions(max_tokens=max_tokens), priority=priority)
    return Sequence(key, request, arrival)


def launch(scheduler: Scheduler, items: list[ScheduledSeq]) -> StepInFlight:
    """Commit the scheduled items as the model runner's next step, with no model: the test supplies the
    step's samples to postprocess."""
    no_draw = Draw(torch.empty(0, dtype=torch.long), [], [], frozenset(), (), None)
    sampled = [item.seq for item in items if item.samples]
    epochs = [item.seq.epoch for item in items]
    drafts = [item.draft for item in items if item.samples]
    step = StepInFlight(scheduler.launched + 1, items, epochs, sampled, drafts, no_draw, 0, [])
    scheduler.commit(step)
    return step


def step(scheduler: Scheduler) -> Step:
    """Schedule once, sample a fake token for each chunk that samples, and postprocess."""
    plan = scheduler.schedule()
    items = [(str(item.seq.key), item.start, item.count, item.samples) for item in plan.items]
    sampled = [item.seq for item in plan.items if item.samples]
    tokens = [FAKE_TOKEN + seq.num_tokens for seq in sampled]
    outputs = scheduler.postprocess(launch(scheduler, plan.items), Samples(tokens, [None] * len(tokens)))
    assert [output.token_ids for output in outputs] == [[token] for token in tokens]
    done = [str(output.key) for output in outputs if output.finish_reason is not None]
    assert all(output.finish_reason is FinishReason.LENGTH for output in outputs if str(output.key) in done)
    return Step(items, [str(output.key) for output in plan.ended], done)


def run_until_idle(scheduler: Scheduler, max_steps: int = 100) -> list[Step]:
    steps: list[Step] = []
    while scheduler.running or scheduler.num_waiting:
        assert len(steps) < max_steps, "the scheduler made no progress"
        steps.append(step(scheduler))
    return steps


def held_pages(kv: LocalKVCache) -> int:
    """Pages the worker holds for sequences: its own in use, plus references on shared ones."""
    usage = kv.usage()
    return usage.in_use_pages + usage.referenced_pages


def assert_settled(kv: LocalKVCache) -> None:
    """No page is held for a sequence, the books are exact, and closing the lease leaves the pool settled."""
    usage = kv.usage()
    assert (usage.in_use_pages, usage.referenced_pages) == (0, 0)
    counts = kv.stats()
    assert counts.leased_pages == usage.idle_pages  # only the local free list is still leased
    assert counts.free_pages + counts.evictable_pages + counts.leased_pages == counts.total_pages
    kv.ledger.check_invariants()
    kv.close()  # the idle pages go back
    assert kv.stats().settled
    kv.ledger.check_invariants()
