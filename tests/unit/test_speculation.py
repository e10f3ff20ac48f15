"""Speculative decoding (services.worker.core.speculation) in the engine, on a small random model.

Sections:

- The n-gram proposer: the longest recent suffix, its latest earlier occurrence, the limit, and the pause
  after drafts that gain nothing.
- Verification in the engine. A random model does not copy its prompt, so most of these tests draft with
  an oracle that knows the speculation-off output and spoils one token of every other draft: each draft is
  then partly kept and partly rolled back, in known amounts. The output must be speculation-off's token for
  token (greedy, seeded, with log-probabilities, logit bias, penalties, min_tokens, stop tokens and
  max_tokens, and resumed after a failover), in fewer steps;
  rejected tokens' pages go back at once and every page is back at the end; drafts run beside plain rows
  and prefill chunks, through preemption, with async scheduling, and publish their pages to the prefix cache.
- A drafted row draws what a plain step after the draft's tokens would (the sampler alone).
- The output distribution of unseeded sampling: the same as speculation-off's (a chi-squared test).
Structured outputs' masks along a draft: tests/integration/test_structured.py; on a real stack:
tests/integration/test_speculative_stack.py.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch

from pagedserve.kernels.torch_ref import TorchBackend
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.draft_model import PROBE_EVERY, DraftModelProposer, Payoff
from services.worker.core.engine import EngineCore
from services.worker.core.engine_config import EngineConfig
from services.worker.core.sampler import draw
from services.worker.core.scheduler import ScheduledSeq
from services.worker.core.sequence import FinishReason, RequestOutput, Sequence
from services.worker.core.speculation import MAX_PAUSE, Drafting, NgramProposer, lookup
from services.worker.kv.base import KVCache
from services.worker.kv.local import LocalKVCache
from services.worker.models import CausalLM, load_model
from tests.models import VOCAB, make_model
from tests.pages import assert_pages_back

# The n-gram proposer ----------------------------------------------------------------------------------------


def test_the_longest_suffix_proposes_what_followed_its_latest_occurrence() -> None:
    tokens = np.array([1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4])
    # The 4-gram 1 2 3 4 occurs at 0 (then 9 9 2); the 3-gram 2 3 4 also at 6 (then 5 6 7): longer wins.
    assert lookup(tokens, 3) == (9, 9, 2)
    assert lookup(np.array([5, 6, 7, 5, 6, 8, 5, 6]), 4) == (8, 5, 6)  # the latest of two occurrences
    assert lookup(np.array([5, 6, 7, 8, 5, 6]), 10) == (7, 8, 5, 6)  # to the end, at most the limit
    assert lookup(np.array([5, 6, 7, 8, 9, 5]), 4) == ()  # one token alone is not enough
    assert lookup(np.array([5, 6]), 4) == ()


def test_the_ngram_proposer_drafts_within_its_limits() -> None:
    proposer = NgramProposer(num_tokens=3)
    seq = Sequence("k", EngineRequest((1, 2, 3, 4, 5, 1, 2), SamplingOptions()), 0)
    assert proposer.propose([(seq, 8), (seq, 2), (seq, 0)]) == [(3, 4, 5), (3, 4), ()]  # num_tokens caps it


def test_a_sequence_pauses_longer_after_each_draft_that_gains_nothing() -> None:
    drafting = Drafting()
    assert not drafting.waits()
    pauses = []
    for _ in range(7):
        drafting.record(accepted=0)
        pauses.append(drafting.pause)
        skipped = 0
        while drafting.waits():
            skipped += 1
        assert skipped == pauses[-1]
    assert pauses == [1, 2, 4, 8, 16, MAX_PAUSE, MAX_PAUSE]
    drafting.record(accepted=1)  # a gain resets it
    drafting.record(accepted=0)
    assert drafting.pause == 1


# Verification in the engine ---------------------------------------------------------------------------------

PROMPTS = [
    [3 + (i * step) % (VOCAB - 5) for i in range(length)] for step, length in ((7, 5), (11, 21), (13, 40))
]
MAX_TOKENS = 20


class Oracle:
    """Drafts the reference output's next tokens, with every other draft's token at offset 1 spoiled unless
    told not to: a kept draft gains all its tokens, a spoiled one gains one (the token before the spoiled
    one)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], num_tokens: int = 4) -> None:
        self.references = references  # prompt -> its whole reference output
        self.num_tokens = num_tokens
        self.spoils = True
        self.drafted: list[tuple[int, ...]] = []
        self.asked: set[tuple[int, ...]] = set()  # the prompts it drafted for

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        return [self.draft(seq.tokens, limit) if limit > 0 else () for seq, limit in requests]

    def release(self, seq: Sequence) -> None:
        pass

    def draft(self, tokens: list[int], limit: int) -> tuple[int, ...]:
        prompt = next(p for p in self.references if tuple(tokens[: len(p)]) == p)
        self.asked.add(prompt)
        done = len(tokens) - len(prompt)
        draft = list(self.references[prompt][done : done + min(limit, self.num_tokens)])
        if self.spoils and len(self.drafted) % 2 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % VOCAB
        self.drafted.append(tuple(draft))
        return tuple(draft)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    folder: Path = make_model("llama", tmp_path_factory.mktemp("llama"))
    return load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=TorchBackend())


def make_engine(
    model: CausalLM,
    *,
    speculative: Literal["off", "ngram"] = "off",
    scheduling: Literal["on", "off"] = "off",
    num_pages: int = 128,
    max_batched_tokens: int = 32,
    draft: CausalLM | None = None,
    draft_pages: int = 128,
    clock: Callable[[], float] = lambda: 0.0,
) -> EngineCore:
    """draft: a draft model (--speculative draft), with a pool of draft_pages, timed by clock: by default
    one that stands still, so that a step's tokens alone say whether drafting pays."""
    kv = LocalKVCache(model.spec.pool_shape("float32", 4), num_pages)
    config = EngineConfig(
        max_batched_tokens=max_batched_tokens,
        max_num_seqs=8,
        async_scheduling=scheduling,
        speculative="draft" if draft is not None else speculative,
    )
    if draft is None:
        return EngineCore(model, kv, config)
    draft_kv = LocalKVCache(draft.spec.pool_shape("float32", 4), draft_pages)
    proposer = DraftModelProposer(draft, draft_kv, 4, max_batched_tokens, model.spec.vocab_size, clock)
    return EngineCore(model, kv, config, proposer=proposer)


def generate(
    engine: EngineCore, options: SamplingOptions | list[SamplingOptions], prompts: list[list[int]] = PROMPTS
) -> dict[int, list[RequestOutput]]:
    each = options if isinstance(options, list) else [options] * len(prompts)
    for key, (prompt, option) in enumerate(zip(prompts, each, strict=True)):
        engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), option)))
    got: dict[int, list[RequestOutput]] = defaultdict(list)
    for output in engine.run_until_done():
        got[output.key].append(output)  # type: ignore[index]
    assert_pages_back(engine.kv)
    return got


LOGPROB_ATOL = 1e-4  # a draft's rows run as a chunk, which sums in another order than a decode


def summary(outputs: dict[int, list[RequestOutput]]) -> dict[int, tuple[list[int], list, str]]:
    """Each request's tokens, log-probabilities (each token's, then its top tokens') and finish reason."""
    return {
        key: (
            [t for o in got for t in o.token_ids],
            [[(lp.token_id, lp.logprob), *lp.top] for o in got for lp in o.logprobs],
            str(got[-1].finish_reason),
        )
        for key, got in outputs.items()
    }


def assert_same(
    got: dict[int, tuple[list[int], list, str]], reference: dict[int, tuple[list[int], list, str]]
) -> None:
    """The same tokens, top tokens and finish reasons; log-probabilities within LOGPROB_ATOL."""
    assert got.keys() == reference.keys()
    for key, (tokens, logprobs, reason) in got.items():
        assert (tokens, reason) == (reference[key][0], reference[key][2]), f"request {key}"
        assert [[t for t, _ in row] for row in logprobs] == [[t for t, _ in row] for row in reference[key][1]]
        values = [v for row in logprobs for _, v in row]
        assert values == pytest.approx([v for row in reference[key][1] for _, v in row], abs=LOGPROB_ATOL)


def with_oracle(
    engine: EngineCore, reference: dict[int, tuple[list[int], list, str]], prompts: list[list[int]] = PROMPTS
) -> Oracle:
    oracle = Oracle({tuple(prompts[key]): tokens for key, (tokens, _, _) in reference.items()})
    engine.scheduler.proposer = oracle  # type: ignore[assignment]
    return oracle


KINDS = {
    "greedy": SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    "seeded": SamplingOptions(
        max_tokens=MAX_TOKENS, temperature=0.8, top_k=40, top_p=0.95, seed=3, ignore_eos=True
    ),
    "logprobs": SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3),
    "logit_bias": SamplingOptions(
        max_tokens=MAX_TOKENS, temperature=0.5, seed=11, logit_bias=((5, 3.0), (9, 2.0))
    ),
}


@pytest.mark.parametrize("scheduling", ["off", "on"])
@pytest.mark.parametrize("kind", KINDS)
def test_drafts_give_the_tokens_of_speculation_off_in_fewer_steps(
    model: CausalLM, kind: str, scheduling: str
) -> None:
    off = make_engine(model, scheduling=scheduling)  # type: ignore[arg-type]
    reference = summary(generate(off, KINDS[kind]))
    engine = make_engine(model, speculative="ngram", scheduling=scheduling)  # type: ignore[arg-type]
    oracle = with_oracle(engine, reference)
    assert_same(summary(generate(engine, KINDS[kind])), reference)
    scheduler = engine.scheduler
    # Each kept draft gains its length; each spoiled one, the one token before the spoiled one.
    assert scheduler.drafts_checked == len(oracle.drafted) > 10
    assert scheduler.accepted_tokens == sum(
        len(d) if i % 2 == 0 or len(d) < 2 else 1 for i, d in enumerate(oracle.drafted)
    )
    assert scheduler.draft_tokens == sum(map(len, oracle.drafted))
    assert engine.steps < off.steps - 3
    assert engine.generation_tokens == off.generation_tokens == len(PROMPTS) * MAX_TOKENS


def test_a_stop_token_inside_a_draft_ends_the_output_there(model: CausalLM) -> None:
    greedy = KINDS["greedy"]
    reference = summary(generate(make_engine(model), greedy))
    tokens = reference[1][0]
    stop = tokens[6]
    expected = tokens[: tokens.index(stop) + 1]
    options = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    engine = make_engine(model, speculative="ngram")
    with_oracle(engine, reference)
    got = generate(engine, options, [PROMPTS[1]])[0]
    assert [t for o in got for t in o.token_ids] == expected
    assert got[-1].finish_reason is FinishReason.STOP
    assert any(len(o.token_ids) > 1 for o in got)  # drafts were kept on the way


def test_min_tokens_holds_an_end_back_at_each_drafted_position(model: CausalLM) -> None:
    """min_tokens 8, with EOS favoured: speculation-off ends with an EOS as the 9th token. A right draft
    across that boundary keeps it there (each row counts its own position), and an EOS that a draft
    proposes before min_tokens is refused at its row, as speculation-off refuses it at its step."""
    eos = model.spec.eos_token_ids[0]
    options = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=8, logit_bias=((eos, 9.0),))
    reference = summary(generate(make_engine(model), options, [PROMPTS[2]]))
    assert reference[0][0][8:] == [eos] and reference[0][2] == "FinishReason.STOP"
    for straddling in (6, 4, 3):  # drafts that reach past the 8th token from the 3rd, 5th and 6th
        engine = make_engine(model, speculative="ngram")
        oracle = with_oracle(engine, reference, [PROMPTS[2]])
        oracle.num_tokens, oracle.spoils = straddling, False
        assert_same(summary(generate(engine, options, [PROMPTS[2]])), reference)
        assert engine.steps < 6
    engine = make_engine(model, speculative="ngram")
    oracle = with_oracle(engine, reference, [PROMPTS[2]])

    def eager_end(tokens: list[int], limit: int) -> tuple[int, ...]:
        draft = Oracle.draft(oracle, tokens, limit)
        return (eos, *draft[1:]) if draft else draft  # an EOS at the first drafted position, always

    oracle.draft = eager_end  # type: ignore[method-assign]
    assert_same(summary(generate(engine, options, [PROMPTS[2]])), reference)
    assert engine.scheduler.drafts_checked > 0


def test_a_draft_never_runs_past_max_tokens(model: CausalLM) -> None:
    """max_tokens 7: after the first token, a draft of at most 5 (its step gives at most 6 tokens)."""
    options = SamplingOptions(max_tokens=7, temperature=0.0, ignore_eos=True)
    reference = summary(generate(make_engine(model), options))
    engine = make_engine(model, speculative="ngram")
    oracle = with_oracle(engine, reference)
    oracle.num_tokens = 16
    assert_same(summary(generate(engine, options)), reference)
    assert max(map(len, oracle.drafted)) == 5
    assert all(len(tokens) == 7 for tokens, _, _ in reference.values())


def test_a_draft_never_runs_past_the_context(tmp_path: Path) -> None:
    """A model that serves 48 positions, a 40-token prompt and drafts of up to 16: the output ends at the
    context's end as speculation-off's does, and the one draft, after the first token, holds all the rest
    but the last (which its step gives)."""
    folder = make_model("llama", tmp_path / "short")
    cpu = torch.device("cpu")
    short = load_model(folder, dtype=torch.float32, device=cpu, backend=TorchBackend(), max_model_len=48)
    options = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = summary(generate(make_engine(short), options, [PROMPTS[2]]))
    tokens, _, reason = reference[0]
    assert (len(tokens), reason) == (48 - len(PROMPTS[2]), "FinishReason.LENGTH")
    engine = make_engine(short, speculative="ngram")
    oracle = with_oracle(engine, reference, [PROMPTS[2]])
    oracle.num_tokens, oracle.spoils = 16, False
    assert_same(summary(generate(engine, options, [PROMPTS[2]])), reference)
    assert oracle.drafted == [tuple(tokens[1:-1])]


def test_rejected_tokens_give_their_pages_back_at_once(model: CausalLM) -> None:
    """Pages of 4 tokens: a prompt of 5 decodes its first token, then drafts 12 tokens, all wrong; the step
    holds pages for 5 + 1 + 12 positions (5 pages) and keeps what 7 tokens need (2)."""
    prompt = PROMPTS[0]
    engine = make_engine(model, speculative="ngram")
    wrong = iter(itertools.cycle([(7,) * 12]))

    class Wrong(Oracle):
        def draft(self, tokens: list[int], limit: int) -> tuple[int, ...]:
            return next(wrong)[:limit]

    engine.scheduler.proposer = Wrong({}, num_tokens=12)
    options = SamplingOptions(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logit_bias=((7, -100.0),)
    )
    seq = engine.new_sequence("r", EngineRequest(tuple(prompt), options))
    engine.add(seq)
    engine.step()  # the prefill, and the first token
    assert seq.num_tokens == 6 and seq.num_pages == 2
    held = engine.kv.usage().in_use_pages
    engine.step()  # a draft of 12, none kept (7 is never drawn)
    assert engine.scheduler.accepted_tokens == 0 and seq.drafting.failures == 1
    assert seq.num_tokens == 7 and seq.num_pages == 2
    assert engine.kv.usage().in_use_pages == held
    engine.run_until_done()
    assert_pages_back(engine.kv)


def test_drafts_run_beside_plain_rows_prefill_chunks_and_preemption(model: CausalLM) -> None:
    """Four requests speculate, one of them with every penalty (each drafted row counts the draft's tokens
    before it as output) and a long prompt prefilled in chunks beside the others' drafts; one turns
    speculation off; the pool is too small to hold them all at once, so some are preempted and recomputed,
    and a draft with no pages left for it falls back to a plain decode."""
    prompts = [*PROMPTS, PROMPTS[1][::-1], [5 + (i * 17) % (VOCAB - 9) for i in range(70)]]
    options = [
        KINDS["greedy"],
        KINDS["seeded"],
        KINDS["logprobs"],
        SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, speculative=False),
        SamplingOptions(
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=4,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.4,
            ignore_eos=True,
        ),
    ]
    off = make_engine(model, num_pages=30)
    reference = summary(generate(off, options, prompts))
    assert off.scheduler.preemptions > 0
    engine = make_engine(model, speculative="ngram", num_pages=30)
    oracle = with_oracle(engine, reference, prompts)
    refused: list[Sequence] = []  # drafts the pool had no pages for
    reserve = engine.scheduler._reserve

    def spy(seq: Sequence, count: int, *, protected: list[ScheduledSeq], may_preempt: bool = True) -> bool:
        held = reserve(seq, count, protected=protected, may_preempt=may_preempt)
        if not held and not may_preempt and seq in engine.scheduler.running:  # a draft's, not an admission's
            refused.append(seq)
        return held

    engine.scheduler._reserve = spy  # type: ignore[method-assign]
    assert_same(summary(generate(engine, options, prompts)), reference)
    assert engine.scheduler.preemptions > 0
    assert refused, "no draft went without pages, so none fell back to a plain decode"
    assert oracle.asked == {tuple(p) for k, p in enumerate(prompts) if k != 3}
    assert 10 < engine.scheduler.drafts_checked <= len(oracle.drafted)
    assert engine.steps < off.steps


def test_kept_tokens_publish_their_pages_to_the_prefix_cache(model: CausalLM) -> None:
    greedy = KINDS["greedy"]
    reference = summary(generate(make_engine(model), greedy, [PROMPTS[2]]))
    engine = make_engine(model, speculative="ngram")
    with_oracle(engine, reference, [PROMPTS[2]])
    generate(engine, greedy, [PROMPTS[2]])
    # The prompt and output again: every full page but the last token's comes from the cache.
    whole = [*PROMPTS[2], *reference[0][0]]
    again = generate(engine, SamplingOptions(max_tokens=1, temperature=0.0), [whole])[0]
    assert again[-1].cached_prompt_tokens == (len(whole) - 1) // 4 * 4


@pytest.mark.parametrize("cut", [1, 7, 13])
def test_a_seeded_request_resumed_on_a_speculating_worker_goes_on_exactly(model: CausalLM, cut: int) -> None:
    """A failover: the tokens one worker sent become the request's `generated` on another, which drafts;
    the rest is what the first would have sent, since each token depends on its seed and position alone."""
    options = KINDS["seeded"]
    reference = summary(generate(make_engine(model), options, [PROMPTS[1]]))
    tokens = reference[0][0]
    engine = make_engine(model, speculative="ngram")
    with_oracle(engine, reference, [PROMPTS[1]])
    request = EngineRequest(tuple(PROMPTS[1]), options, generated=tuple(tokens[:cut]))
    engine.add(engine.new_sequence("r", request))
    rest = [t for output in engine.run_until_done() for t in output.token_ids]
    assert rest == tokens[cut:]
    assert engine.scheduler.accepted_tokens > 0
    assert_pages_back(engine.kv)


def test_a_drafted_row_draws_as_the_step_after_its_draft_would(model: CausalLM) -> None:
    """The sampler's row for the token after a draft's tokens (prefixes) draws exactly what a plain step
    draws once those tokens are the sequence's: seeded noise at its position, min_tokens counted there,
    and penalties counting the draft's tokens as output."""
    options = SamplingOptions(
        max_tokens=20,
        temperature=0.9,
        seed=21,
        min_tokens=4,
        repetition_penalty=1.5,
        frequency_penalty=1.0,
        presence_penalty=1.5,
    )
    prompt, output, draft = (5, 6, 7, 8), [9, 10], (11, 12, 9)
    drafted = Sequence("a", EngineRequest(prompt, options), 0)
    drafted.tokens += output
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[:, [11, 12]] += 9.0  # the draft's tokens: drawn almost surely, unless penalized as output
    logits[:, model.spec.eos_token_ids[0]] += 6.0  # an end that min_tokens holds back at first
    rows = [drafted] * 4
    prefixes = [draft[:offset] for offset in range(4)]
    got = draw(logits, rows, frozenset(model.spec.eos_token_ids), None, prefixes).samples().token_ids
    for offset in range(4):
        plain = Sequence("b", EngineRequest(prompt, options), 0)
        plain.tokens += [*output, *draft[:offset]]
        alone = draw(logits[offset : offset + 1], [plain], frozenset(model.spec.eos_token_ids))
        assert got[offset] == alone.samples().token_ids[0], f"row {offset}"
    without = draw(logits, rows, frozenset(model.spec.eos_token_ids)).samples().token_ids
    assert without != got  # the prefixes matter here


# The draft model -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """A draft of its own: one layer, other weights, the same vocabulary; it rarely agrees with `model`."""
    folder = make_model("llama", tmp_path_factory.mktemp("small"), seed=5, num_hidden_layers=1)
    return load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=TorchBackend())


def assert_draft_pages_back(kv: KVCache) -> None:
    """No shadow holds a page of the draft model's pool. (It publishes none, so the pool's owner hears of
    its idle pages only at its next lease: its lease's count of them may lag.)"""
    usage = kv.usage()
    assert (usage.in_use_pages, usage.referenced_pages) == (0, 0), usage
    assert isinstance(kv, LocalKVCache)
    kv.ledger.check_invariants()


@pytest.mark.parametrize("scheduling", ["off", "on"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_draft_model_gives_the_tokens_of_speculation_off(
    model: CausalLM, kind: str, scheduling: str
) -> None:
    """The target model drafting for itself: its greedy drafts are its own greedy tokens, so a greedy
    request keeps every drafted token (a 40-token prompt is caught up in chunks of the step's budget, 32);
    sampled ones keep few. Every page of both pools is back at the end."""
    off = make_engine(model, scheduling=scheduling)  # type: ignore[arg-type]
    reference = summary(generate(off, KINDS[kind]))
    engine = make_engine(model, draft=model, scheduling=scheduling)  # type: ignore[arg-type]
    assert_same(summary(generate(engine, KINDS[kind])), reference)
    scheduler, draft = engine.scheduler, engine.draft
    assert draft is not None and scheduler.drafts_checked > 5
    if kind in ("greedy", "logprobs"):
        assert scheduler.accepted_tokens == scheduler.draft_tokens
        assert engine.steps < off.steps / 2
    else:  # sampled from the random model's flat distributions: its greedy drafts seldom match
        assert scheduler.accepted_tokens < scheduler.draft_tokens
    assert engine.generation_tokens == off.generation_tokens
    assert_draft_pages_back(draft.kv)


def test_a_draft_model_that_disagrees_changes_nothing_but_the_steps(
    model: CausalLM, small_model: CausalLM
) -> None:
    """Another model's drafts, mostly wrong, through preemption in a small pool and a draft pool too small
    for every sequence (those without pages go without drafts): the output is still speculation-off's, and
    drafts that gain nothing pause."""
    prompts = [*PROMPTS, [5 + (i * 17) % (VOCAB - 9) for i in range(70)]]
    options = [KINDS["greedy"], KINDS["seeded"], KINDS["logprobs"], KINDS["logit_bias"]]
    off = make_engine(model, num_pages=30)
    reference = summary(generate(off, options, prompts))
    engine = make_engine(model, draft=small_model, num_pages=30, draft_pages=30)
    assert_same(summary(generate(engine, options, prompts)), reference)
    scheduler = engine.scheduler
    assert scheduler.preemptions > 0 and scheduler.drafts_checked > 0
    assert scheduler.accepted_tokens < scheduler.draft_tokens / 2
    assert scheduler.drafts_checked < off.steps  # paused, not drafting at every step
    assert engine.draft is not None
    assert_draft_pages_back(engine.draft.kv)


def test_the_draft_models_kv_follows_what_the_check_kept(model: CausalLM) -> None:
    """Each step's drafts equal those of a fresh draft model that computes the sequence's tokens whole,
    yet the draft model runs each position about once: after a check it keeps the KV of the draft's kept
    tokens, and runs only what it lacks (the tokens from the first rejected one, and the sequence's last
    one). The shadow's pages go back with the sequence."""
    options = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logit_bias=((9, 2.5),))
    engine = make_engine(model, draft=model)
    draft = engine.draft
    assert draft is not None
    propose, run = draft._draft, draft._run  # drafting itself, on the steps that draft
    ran: list[int] = []  # each pass's tokens
    catch_ups: list[int] = []  # each proposal's first pass's tokens

    def checked(requests: list[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        passes = len(ran)
        drafts = propose(requests)
        catch_ups.extend(ran[passes : passes + 1])  # none where no draft fits (max_tokens is near)
        assert set(ran[passes + 1 :]) <= {1}
        fresh = DraftModelProposer(model, LocalKVCache(draft.kv.shape, 64), 4, 4096, VOCAB)
        assert fresh._draft(requests) == drafts
        return drafts

    def counted(items: list) -> list:
        ran.extend(item.count for item in items)
        return run(items)

    draft._draft, draft._run = checked, counted  # type: ignore[method-assign]
    seq = engine.new_sequence("r", EngineRequest(tuple(PROMPTS[1]), options))
    engine.add(seq)
    engine.run_until_done()
    scheduler = engine.scheduler
    assert 0 < scheduler.accepted_tokens < scheduler.draft_tokens  # the bias made some drafts miss
    # The prompt and the first token, then at most the draft's last token and the token after it.
    assert catch_ups[0] == len(PROMPTS[1]) + 1
    assert max(catch_ups[1:]) == 2 and len(catch_ups) > 4
    assert "r" not in draft._shadows
    assert_draft_pages_back(draft.kv)


def test_payoff_takes_the_faster_way_and_probes_the_other_less_while_it_stays_behind() -> None:
    payoff = Payoff()
    assert payoff.drafts() is True  # unmeasured: tried first
    payoff.measured(True, 4.0, 2.0)  # 2 tokens a second with drafts
    assert payoff.drafts() is False
    payoff.measured(False, 1.0, 1.0)  # 1 without
    choices = []
    for _ in range(PROBE_EVERY * 7):
        choices.append(payoff.drafts())
        payoff.measured(choices[-1], 4.0 if choices[-1] else 1.0, 2.0 if choices[-1] else 1.0)
    probes = [step for step, drafted in enumerate(choices) if not drafted]
    # Each probe (the same rates: the choice holds) doubles the wait for the next.
    assert [b - a for a, b in itertools.pairwise(probes)] == [2 * PROBE_EVERY, 4 * PROBE_EVERY]
    assert payoff.probe_every == 8 * PROBE_EVERY
    while payoff.drafts():  # the next probe, and the way without drafts is now the faster
        payoff.measured(True, 4.0, 2.0)
    payoff.measured(False, 10.0, 1.0)
    assert payoff.drafts() is False and payoff.probe_every == PROBE_EVERY


@pytest.mark.parametrize(("pass_cost", "pays"), [(0.1, True), (2.0, False)])
def test_a_draft_model_drafts_only_while_it_pays(model: CausalLM, pass_cost: float, pays: bool) -> None:
    """A clock on which a step costs 1 and each draft pass pass_cost: the target drafting for itself gains 5
    tokens a drafted step (4 passes), so at 0.1 a pass drafting gives 5 / 1.4 tokens a unit of time against
    1 without it, and at 2.0 it gives 5 / 9. The proposer drafts while that pays, and otherwise only probes
    one step in PROBE_EVERY; the tokens are speculation-off's either way."""
    options = SamplingOptions(max_tokens=60, temperature=0.0, ignore_eos=True)
    reference = summary(generate(make_engine(model), options, [PROMPTS[0]]))
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # the proposer reads it once a step
        return now[0]

    engine = make_engine(model, draft=model, clock=clock)
    draft = engine.draft
    assert draft is not None
    run = draft._run

    def timed(items: list) -> list:
        now[0] += pass_cost
        return run(items)

    draft._run = timed  # type: ignore[method-assign]
    assert_same(summary(generate(engine, options, [PROMPTS[0]])), reference)
    checked, steps = engine.scheduler.drafts_checked, engine.steps
    if pays:
        assert checked >= steps - 3 and draft.payoff.rates[True] > draft.payoff.rates[False]
    else:
        assert (
            0 < checked <= 2 + steps // PROBE_EVERY and draft.payoff.rates[True] < draft.payoff.rates[False]
        )


def spy_on_drafts(engine: EngineCore) -> list[tuple[int, ...]]:
    """The drafts the engine's draft model proposes from now on."""
    draft = engine.draft
    assert draft is not None
    propose = draft._draft
    proposed: list[tuple[int, ...]] = []

    def spied(requests: list[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        proposed.extend(propose(requests))
        return proposed[-len(requests) :]

    draft._draft = spied  # type: ignore[method-assign]
    return proposed


def test_a_draft_model_never_proposes_its_padding(model: CausalLM, tmp_path: Path) -> None:
    """A draft model whose vocabulary is padded past the target's (1024 ids to 512): its random logits there
    are often its largest, yet it proposes only the target's ids, and the output is speculation-off's."""
    folder = make_model("llama", tmp_path / "padded", seed=5, vocab_size=2 * VOCAB)
    padded = load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=TorchBackend())
    reference = summary(generate(make_engine(model), KINDS["greedy"]))
    engine = make_engine(model, draft=padded)
    proposed = spy_on_drafts(engine)
    assert_same(summary(generate(engine, KINDS["greedy"])), reference)
    tokens = [token for draft in proposed for token in draft]
    assert len(tokens) > 10 and max(tokens) < VOCAB


def test_a_draft_model_of_a_shorter_context_drafts_only_within_it(model: CausalLM, tmp_path: Path) -> None:
    """The target's own weights with a context of 48 positions for drafting, the target's 512: a 40-token
    prompt's drafts stop where the draft model would write past position 47 (a draft's last token is not
    run through it), and the output is speculation-off's, every draft kept."""
    folder = make_model("llama", tmp_path / "short")  # the `model` fixture's weights
    cpu = torch.device("cpu")
    short = load_model(folder, dtype=torch.float32, device=cpu, backend=TorchBackend(), max_model_len=48)
    reference = summary(generate(make_engine(model), KINDS["greedy"], [PROMPTS[2]]))
    engine = make_engine(model, draft=short)
    draft = engine.draft
    assert draft is not None
    run = draft._run
    written: list[int] = []  # each pass's last position

    def counted(items: list[ScheduledSeq]) -> list:
        written.extend(item.start + item.count - 1 for item in items)
        return run(items)

    draft._run = counted  # type: ignore[method-assign]
    assert_same(summary(generate(engine, KINDS["greedy"], [PROMPTS[2]])), reference)
    scheduler = engine.scheduler
    assert scheduler.drafts_checked > 1 and scheduler.accepted_tokens == scheduler.draft_tokens
    assert max(written) == 47  # up to the end of its context, and no further


def test_a_draft_model_needs_speculative_draft(model: CausalLM) -> None:
    kv = LocalKVCache(model.spec.pool_shape("float32", 4), 16)
    proposer = DraftModelProposer(model, kv, 4, 32, model.spec.vocab_size)
    with pytest.raises(ValueError, match="--speculative draft"):
        EngineCore(model, kv, EngineConfig(speculative="ngram"), proposer=proposer)
    with pytest.raises(ValueError, match="--speculative draft"):
        EngineCore(model, kv, EngineConfig(speculative="draft"))


# The output distribution of unseeded sampling ---------------------------------------------------------------


def test_unseeded_sampling_draws_from_the_models_distribution(model: CausalLM) -> None:
    """600 unseeded samples of 3 tokens each, speculation off and with a draft of the most likely tokens:
    the third token's distribution agrees (a chi-squared test over the tokens seen 10 times or more), where
    keeping drafts too often would favour the greedy token."""
    prompt = PROMPTS[1]
    options = SamplingOptions(max_tokens=3, temperature=1.5, top_k=8, ignore_eos=True)
    greedy = summary(
        generate(
            make_engine(model), SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True), [prompt]
        )
    )

    def third_tokens(speculative: Literal["off", "ngram"]) -> Counter[int]:
        engine = make_engine(model, speculative=speculative, max_batched_tokens=2048)
        if speculative == "ngram":
            with_oracle(engine, greedy, [prompt]).num_tokens = 2
        outputs = generate(engine, options, [prompt] * 600)
        return Counter([t for o in got for t in o.token_ids][2] for got in outputs.values())

    off, on = third_tokens("off"), third_tokens("ngram")
    common = [t for t in off if off[t] + on[t] >= 10]
    table = np.array([[off[t] for t in common], [on[t] for t in common]], dtype=float)
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    # With len(common) - 1 degrees of freedom, chi2 is below 3x them but with negligible chance when the
    # distributions are the same; a draft whose tokens were always kept would move a clear share of the
    # mass to the greedy token.
    assert len(common) >= 3 and chi2 < 3 * (len(common) - 1) + 10, (off, on, chi2)
