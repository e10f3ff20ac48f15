"""The batched sampler against straightforward references of vLLM's SamplingParams meanings, and the checks
SamplingOptions makes of its fields.

Every test that draws random logits seeds torch itself, so the logits and the sampler's own noise are
reproducible. The references come first: plain Python loops over lists (float64), independent of the
sampler's tensor code. Then the sections: 1. greedy rows; 2. top_k, top_p and min_p filtering; 3. the
distribution it draws from; 4. repetition, frequency and presence penalties; 5. per-request seeds that make
a row independent of its batch; 6. log-probabilities (of the raw model output); 7. the checks of the
options; tiny temperatures; and what a request allows before it samples: logit bias, min_tokens' hold-back
of EOS and stop tokens, a grammar's mask, and a seeded draw whose noise is exactly zero somewhere.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import replace

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument
from services.common.request import EngineRequest
from services.common.sampling import MAX_LOGPROBS, SamplingOptions
from services.common.structured import Constraint
from services.worker.core.grammar import Grammars, fill_masks
from services.worker.core.sampler import apply_penalties, filtered_probs, sample, seeded_noise
from services.worker.core.sequence import Sequence

# Sequences, batches and references --------------------------------------------------------------------------


def make_seq(
    options: SamplingOptions, prompt: Seq[int] = (1, 2, 3), output: Seq[int] = (), key: str = "r0"
) -> Sequence:
    return Sequence(key, EngineRequest(tuple(prompt), options, generated=tuple(output)), arrival=0)


def copies(row: torch.Tensor, options: SamplingOptions, n: int) -> tuple[torch.Tensor, list[Sequence]]:
    """A batch of n identical rows that all ask for the same options."""
    logits = row[None, :].expand(n, row.shape[0]).contiguous()
    return logits, [make_seq(options, key=f"r{i}") for i in range(n)]


def softmax_list(row: Seq[float], temperature: float = 1.0) -> list[float]:
    scaled = [x / temperature for x in row]
    top = max(scaled)
    exps = [math.exp(x - top) for x in scaled]
    total = sum(exps)
    return [e / total for e in exps]


def reference_allowed(
    row: Seq[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """The tokens vLLM may emit: min_p first, then top_k, then top_p over the renormalized survivors."""
    probs = softmax_list(row, temperature)
    best = max(probs)
    survivors = [i for i, p in enumerate(probs) if p >= min_p * best]
    survivors.sort(key=lambda i: probs[i], reverse=True)
    if top_k > 0:
        survivors = survivors[:top_k]
    mass = sum(probs[i] for i in survivors)
    kept: list[int] = []
    cumulative = 0.0
    for i in survivors:
        kept.append(i)
        cumulative += probs[i] / mass
        if cumulative >= top_p:
            break
    return set(kept)


def boundary_margin(row: Seq[float], temperature: float, top_k: int, top_p: float, min_p: float) -> float:
    """How far the case is from a cut-off, so that fp32 rounding cannot flip a token in or out."""
    probs = softmax_list(row, temperature)
    best = max(probs)
    margins = [abs(p - min_p * best) for p in probs] if min_p > 0 else [1.0]
    survivors = sorted((p for p in probs if p >= min_p * best), reverse=True)
    if top_k > 0:
        survivors = survivors[:top_k]
    if top_p < 1.0:
        mass = sum(survivors)
        cumulative = 0.0
        for p in survivors:
            cumulative += p / mass
            margins.append(abs(cumulative - top_p))
    return min(margins)


def reference_penalties(row: Seq[float], seq: Sequence) -> list[float]:
    """vLLM's penalties, one token at a time."""
    o = seq.options
    prompt, output = seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :]
    out = list(row)
    if o.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            out[t] = out[t] / o.repetition_penalty if out[t] > 0 else out[t] * o.repetition_penalty
    for t, count in Counter(output).items():
        out[t] -= o.frequency_penalty * count + o.presence_penalty
    return out


def log_probs_of(token_probs: Seq[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in token_probs], dtype=torch.float32)


# 1. Greedy --------------------------------------------------------------------------------------------------


def test_all_greedy_batch_takes_the_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 100) * 3
    seqs = [make_seq(SamplingOptions(temperature=0.0), key=f"r{i}") for i in range(16)]
    assert sample(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_take_the_argmax_when_mixed_with_sampled_rows() -> None:
    torch.manual_seed(2)
    logits = torch.randn(12, 64) * 2
    options = [
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=1.0),
        SamplingOptions(temperature=0.0, seed=5),
        SamplingOptions(temperature=1.3, top_k=4, top_p=0.8),
        SamplingOptions(temperature=0.0, top_k=3, min_p=0.5),  # filters are moot for greedy rows
        SamplingOptions(temperature=2.0, seed=9),
    ] * 2
    seqs = [make_seq(o, key=f"r{i}") for i, o in enumerate(options)]
    before = logits.clone()
    for _ in range(20):
        tokens = sample(logits, seqs).token_ids
        for row, o in enumerate(options):
            if o.greedy:
                assert tokens[row] == int(logits[row].argmax()), f"row {row}"
    torch.testing.assert_close(logits, before, rtol=0, atol=0)  # the caller's logits are not touched


# 2. Filtering: top_k, top_p, min_p --------------------------------------------------------------------------

FILTER_CASES = [
    # (seed, temperature, top_k, top_p, min_p)
    (10, 1.0, 5, 1.0, 0.0),
    (11, 1.0, 0, 0.6, 0.0),
    (12, 1.0, -1, 1.0, 0.1),
    (13, 1.0, 10, 0.8, 0.0),
    (14, 0.8, 0, 0.7, 0.05),
    (15, 0.7, 3, 0.9, 0.2),
    (16, 1.5, 0, 0.5, 0.0),
    (17, 1.2, 8, 0.75, 0.03),
]


@pytest.mark.parametrize(("seed", "temperature", "top_k", "top_p", "min_p"), FILTER_CASES)
def test_filtered_probs_keep_exactly_the_reference_set(
    seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    torch.manual_seed(seed)
    row = torch.randn(32) * 2
    values = row.tolist()
    assert boundary_margin(values, temperature, top_k, top_p, min_p) > 1e-4, "the case sits on a cut-off"
    allowed = reference_allowed(values, temperature, top_k, top_p, min_p)
    options = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)

    probs = filtered_probs(row[None, :], [options])[0]
    assert set(torch.nonzero(probs).flatten().tolist()) == allowed
    # Kept tokens keep their (unnormalized) post-temperature probability.
    expected = torch.tensor(softmax_list(values, temperature), dtype=torch.float32)
    kept = sorted(allowed)
    torch.testing.assert_close(probs[kept], expected[kept], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("seed", "temperature", "top_k", "top_p", "min_p"), FILTER_CASES)
def test_sampling_never_leaves_the_allowed_set(
    seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    torch.manual_seed(seed)
    row = torch.randn(32) * 2
    values = row.tolist()
    assert boundary_margin(values, temperature, top_k, top_p, min_p) > 1e-4, "the case sits on a cut-off"
    allowed = reference_allowed(values, temperature, top_k, top_p, min_p)
    options = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)

    logits, seqs = copies(row, options, 2000)
    drawn = Counter(sample(logits, seqs).token_ids)
    assert set(drawn) <= allowed, f"emitted {sorted(set(drawn) - allowed)}, allowed {sorted(allowed)}"
    # Not degenerate: every allowed token with at least 1% of the kept mass shows up (miss chance < 1e-8).
    probs = softmax_list(values, temperature)
    mass = sum(probs[i] for i in allowed)
    likely = {i for i in allowed if probs[i] / mass >= 0.01}
    assert likely <= set(drawn), f"never drew {sorted(likely - set(drawn))}"
    if len(likely) > 1:
        assert len(drawn) > 1


@pytest.mark.parametrize(
    ("token_probs", "top_k", "top_p", "min_p", "allowed", "naive"),
    [
        # min_p (0.2 * 0.5 = 0.1) drops 0.05 first; top_p then sees [.526, .316, .158]: {0, 1} reach 0.82.
        # Applied to the raw distribution instead, 0.5 + 0.3 = 0.8 < 0.82 would keep token 2 as well.
        ([0.5, 0.3, 0.15, 0.05], 0, 0.82, 0.2, {0, 1}, {0, 1, 2}),
        # top_k=2 leaves [.4, .3], renormalized [.571, .429]: token 0 alone reaches 0.55.
        # Without renormalization 0.4 < 0.55 would keep token 1 as well.
        ([0.4, 0.3, 0.2, 0.1], 2, 0.55, 0.0, {0}, {0, 1}),
    ],
)
def test_top_p_applies_to_what_min_p_and_top_k_left_renormalized(
    token_probs: list[float], top_k: int, top_p: float, min_p: float, allowed: set[int], naive: set[int]
) -> None:
    torch.manual_seed(20)
    row = log_probs_of(token_probs)
    assert reference_allowed(row.tolist(), 1.0, top_k, top_p, min_p) == allowed
    assert allowed != naive
    options = SamplingOptions(top_k=top_k, top_p=top_p, min_p=min_p)
    assert set(torch.nonzero(filtered_probs(row[None, :], [options])[0]).flatten().tolist()) == allowed
    logits, seqs = copies(row, options, 2000)
    assert set(sample(logits, seqs).token_ids) == allowed


def test_min_p_compares_with_the_best_token_after_temperature() -> None:
    """At temperature 2, [.6, .3, .1] flattens to [.47, .33, .19]: with min_p 0.35 token 2 stays (.19 is over
    .35 * .47), though it falls below .35 times the raw best (.21)."""
    row = log_probs_of([0.6, 0.3, 0.1])
    assert reference_allowed(row.tolist(), 2.0, 0, 1.0, 0.35) == {0, 1, 2}
    assert reference_allowed(row.tolist(), 1.0, 0, 1.0, 0.35) == {0, 1}
    options = SamplingOptions(temperature=2.0, min_p=0.35)
    assert set(torch.nonzero(filtered_probs(row[None, :], [options])[0]).flatten().tolist()) == {0, 1, 2}
    torch.manual_seed(22)
    logits, seqs = copies(row, options, 2000)
    assert set(sample(logits, seqs).token_ids) == {0, 1, 2}


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, 2), (0.75, 3), (0.25, 1)])
def test_top_p_stops_at_the_token_whose_mass_reaches_it_exactly(top_p: float, kept: int) -> None:
    """Four equal tokens (probabilities of exactly 0.25): the smallest prefix whose mass reaches top_p, and
    not one token more, as in vLLM (its mask drops tokens while the mass below them is at most 1 - top_p)."""
    row = torch.zeros(4)
    assert len(reference_allowed(row.tolist(), 1.0, 0, top_p, 0.0)) == kept
    probs = filtered_probs(row[None, :], [SamplingOptions(top_p=top_p)])[0]
    assert int(torch.count_nonzero(probs)) == kept


def test_filters_on_one_row_do_not_touch_the_others() -> None:
    torch.manual_seed(21)
    logits = torch.randn(3, 40)
    options = [
        SamplingOptions(temperature=0.9),
        SamplingOptions(top_k=2, top_p=0.3, min_p=0.4),
        SamplingOptions(temperature=1.7),
    ]
    probs = filtered_probs(logits, options)
    for row in (0, 2):
        expected = torch.softmax(logits[row] / options[row].temperature, dim=-1)
        torch.testing.assert_close(probs[row], expected, rtol=0, atol=0)


# 3. The distribution ----------------------------------------------------------------------------------------


def assert_frequencies_match(tokens: list[int], expected: Seq[float]) -> None:
    """Every token's frequency within 5 standard errors (plus a hair) of its expected probability."""
    n = len(tokens)
    counts = Counter(tokens)
    for t, p in enumerate(expected):
        se = math.sqrt(p * (1 - p) / n)
        freq = counts.get(t, 0) / n
        assert abs(freq - p) <= 5 * se + 1e-3, f"token {t}: frequency {freq:.4f}, probability {p:.4f}"
    assert set(counts) <= {t for t, p in enumerate(expected) if p > 0}


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_temperature_sampling_follows_softmax(temperature: float) -> None:
    torch.manual_seed(30)
    row = torch.randn(8)
    logits, seqs = copies(row, SamplingOptions(temperature=temperature), 5000)
    tokens = sample(logits, seqs).token_ids
    assert_frequencies_match(tokens, softmax_list(row.tolist(), temperature))


def test_top_k_sampling_follows_the_renormalized_distribution() -> None:
    torch.manual_seed(31)
    row = torch.randn(8)
    probs = softmax_list(row.tolist())
    kept = sorted(range(8), key=lambda i: probs[i], reverse=True)[:3]
    mass = sum(probs[i] for i in kept)
    expected = [probs[i] / mass if i in kept else 0.0 for i in range(8)]
    logits, seqs = copies(row, SamplingOptions(top_k=3), 5000)
    assert_frequencies_match(sample(logits, seqs).token_ids, expected)


# 4. Penalties -----------------------------------------------------------------------------------------------


def test_penalties_by_hand() -> None:
    # Token 1: prompt only, positive. Token 2: prompt only, negative. Token 3: output x3, positive, also in
    # the prompt. Token 4: output once, negative. Token 5: untouched.
    logits = torch.tensor([[0.5, 2.0, -1.0, 3.0, -0.5, 1.5]])
    seq = make_seq(
        SamplingOptions(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        prompt=[1, 2, 3],
        output=[3, 4, 3, 3],
    )
    expected = torch.tensor([[0.5, 1.0, -2.0, 3.0 / 2 - 3 * 0.5 - 0.25, -0.5 * 2 - 0.5 - 0.25, 1.5]])
    torch.testing.assert_close(apply_penalties(logits.clone(), [seq]), expected)


def penalty_batch() -> list[Sequence]:
    prompt = [3, 5, 5, 7, 11, 0]
    output = [5, 9, 9, 9, 2, 11, 2, 40]
    return [
        make_seq(
            SamplingOptions(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7),
            prompt,
            output,
        ),
        make_seq(SamplingOptions(frequency_penalty=1.1), prompt, output, key="freq"),
        make_seq(SamplingOptions(presence_penalty=-0.6), prompt, output, key="presence"),
        make_seq(SamplingOptions(repetition_penalty=0.8), prompt, output, key="rep<1"),
        make_seq(SamplingOptions(), prompt, output, key="none"),
        make_seq(
            SamplingOptions(repetition_penalty=1.7, frequency_penalty=-0.3), [8, 8, 1], [], key="no-output"
        ),
    ]


def test_apply_penalties_matches_the_reference() -> None:
    torch.manual_seed(40)
    logits = torch.randn(6, 48) * 3
    seqs = penalty_batch()
    expected = torch.tensor(
        [reference_penalties(row, seq) for row, seq in zip(logits.tolist(), seqs, strict=True)],
        dtype=torch.float32,
    )
    actual = apply_penalties(logits.clone(), seqs)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(actual[4], logits[4], rtol=0, atol=0)  # the unpenalized row is untouched


def test_greedy_pick_under_penalties_matches_the_reference() -> None:
    torch.manual_seed(41)
    logits = torch.randn(6, 48)
    seqs = penalty_batch()
    # Make each row's raw favourite a token the penalties hit, so the penalties decide the pick.
    for row, favourite in enumerate([9, 9, 2, 5, 9, 8]):
        logits[row, favourite] = logits[row].max() + 0.3
    for seq in seqs:
        seq.options = replace(seq.options, temperature=0.0)
    penalized = [reference_penalties(row, seq) for row, seq in zip(logits.tolist(), seqs, strict=True)]
    expected = [max(range(48), key=row.__getitem__) for row in penalized]
    assert sample(logits, seqs).token_ids == expected
    moved = [row for row in range(6) if expected[row] != int(logits[row].argmax())]
    assert moved == [0, 1, 5], "the penalties should move the pick on the rows that push down"


# 5. Per-request seeds ---------------------------------------------------------------------------------------

SEEDED_OPTIONS = [
    SamplingOptions(temperature=1.0, seed=123),
    SamplingOptions(temperature=0.7, top_p=0.9, repetition_penalty=1.2, seed=123),
]


def run_seeded(options: SamplingOptions, step_logits: list[torch.Tensor], row: int, others: int) -> list[int]:
    """Sample one token per step for a fresh seeded sequence at `row` among `others` unrelated rows."""
    seq = make_seq(options, prompt=[4, 5, 6], key="seeded")
    neighbours = [
        make_seq(SamplingOptions(temperature=1.0), key="unseeded"),
        make_seq(SamplingOptions(temperature=0.8, top_k=5, seed=7), key="other-seed"),
        make_seq(SamplingOptions(temperature=0.0), key="greedy"),
        make_seq(SamplingOptions(temperature=1.4, seed=123, min_p=0.1), key="same-seed-other-options"),
    ][:others]
    tokens: list[int] = []
    for logits_row in step_logits:
        batch = [*neighbours]
        batch.insert(row, seq)
        logits = torch.randn(len(batch), logits_row.shape[0]) * 2  # the neighbours' logits differ per run
        logits[row] = logits_row
        torch.randn(17)  # move the global generator along as unrelated work would
        samples = sample(logits, batch)
        for s, token in zip(batch, samples.token_ids, strict=True):
            s.tokens.append(token)
        tokens.append(samples.token_ids[row])
    return tokens


@pytest.mark.parametrize("options", SEEDED_OPTIONS)
def test_seeded_row_does_not_depend_on_the_batch(options: SamplingOptions) -> None:
    torch.manual_seed(50)
    step_logits = [torch.randn(50) * 0.5 for _ in range(12)]
    alone = run_seeded(options, step_logits, row=0, others=0)
    torch.manual_seed(51)
    batched = run_seeded(options, step_logits, row=2, others=4)
    torch.manual_seed(52)
    last = run_seeded(options, step_logits, row=3, others=3)
    assert batched == alone
    assert last == alone
    assert len(set(alone)) > 3, "the seeded row should actually be sampling"


def test_different_seeds_give_different_tokens() -> None:
    torch.manual_seed(53)
    step_logits = [torch.randn(50) * 0.1 for _ in range(20)]
    first = run_seeded(SamplingOptions(seed=123), step_logits, row=0, others=0)
    second = run_seeded(SamplingOptions(seed=124), step_logits, row=0, others=0)
    again = run_seeded(SamplingOptions(seed=123), step_logits, row=0, others=2)
    assert first != second
    assert sum(a == b for a, b in zip(first, second, strict=True)) <= 5
    assert again == first


def test_seeded_noise_depends_on_all_64_bits_of_the_seed_and_the_position_alone() -> None:
    noise = seeded_noise(1, 7, 1000)
    assert torch.equal(noise, seeded_noise(1, 7, 1000))
    for other in (
        seeded_noise(1 + 2**32, 7, 1000),
        seeded_noise(1 + 2**63, 7, 1000),
        seeded_noise(1, 8, 1000),
    ):
        assert not torch.equal(noise, other)
    assert not torch.equal(seeded_noise(-1, 0, 100), seeded_noise(2**32 - 1, 0, 100))
    assert noise.min() > 0 and abs(noise.mean().item() - 1.0) < 0.1  # Exp(1)


# 6. Log-probabilities ---------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_model_log_softmax() -> None:
    torch.manual_seed(60)
    logits = torch.randn(5, 64) * 2
    prompt, output = [1, 2, 3], [7, 7, 9]
    options = [
        SamplingOptions(logprobs=3, temperature=0.5, top_k=10, repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingOptions(logprobs=0, temperature=0.9),
        SamplingOptions(logprobs=5, temperature=0.0, presence_penalty=2.0),
        SamplingOptions(logprobs=1, temperature=1.3, seed=3),
        SamplingOptions(logprobs=MAX_LOGPROBS, temperature=2.0, top_p=0.5, min_p=0.1),
    ]
    logits[2, 7] = logits[2].max() + 1.0  # the greedy row's penalties move its pick off token 7
    seqs = [make_seq(o, prompt, output, key=f"r{i}") for i, o in enumerate(options)]
    raw = logits.clone()
    samples = sample(logits, seqs)
    assert samples.token_ids[2] != 7

    reference = torch.log_softmax(raw.double(), dim=-1)
    for row, o in enumerate(options):
        result = samples.logprobs[row]
        if o.logprobs == 0:
            assert result is None
            continue
        assert result is not None
        token = samples.token_ids[row]
        assert result.token_id == token
        assert result.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)
        assert len(result.top) == o.logprobs
        top_values, top_ids = reference[row].topk(o.logprobs)
        assert [t for t, _ in result.top] == top_ids.tolist()
        values = [lp for _, lp in result.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(top_values.tolist(), abs=1e-5)


def test_no_row_asks_for_logprobs() -> None:
    torch.manual_seed(61)
    logits = torch.randn(3, 20)
    seqs = [make_seq(SamplingOptions(temperature=t), key=f"r{i}") for i, t in enumerate([0.0, 1.0, 0.5])]
    assert sample(logits, seqs).logprobs == [None, None, None]


# 7. Validation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("temperature", 101.0),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", -0.1),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("min_p", 2.0),
        ("min_p", -0.01),
        ("top_k", -5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-39),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 1000.0),
        ("presence_penalty", 3.0),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", float("-inf")),
        ("logprobs", 100),
        ("logprobs", -1),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("seed", 1 << 63),
    ],
)
def test_bad_options_raise_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidArgument, match=rf"\bsampling\.{field}\b"):
        SamplingOptions(**{field: value})


def test_too_many_stop_token_ids_raise() -> None:
    with pytest.raises(InvalidArgument, match=r"sampling\.stop_token_ids"):
        SamplingOptions(stop_token_ids=tuple(range(65)))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0.0),
        ("temperature", 100.0),
        ("top_p", 1.0),
        ("top_p", 1e-6),
        ("top_k", -1),
        ("top_k", 0),
        ("min_p", 1.0),
        ("repetition_penalty", 100.0),
        ("repetition_penalty", 0.001),
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("logprobs", MAX_LOGPROBS),
        ("max_tokens", 1),
        ("seed", -(1 << 63)),
    ],
)
def test_edge_values_are_accepted(field: str, value: float) -> None:
    assert getattr(SamplingOptions(**{field: value}), field) == value


# Tiny temperatures ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 1e-45])
def test_tiny_positive_temperature_behaves_like_greedy(temperature: float) -> None:
    # Dividing fp32 logits by a temperature below ~1e-38 overflows and the softmax turns into NaN; as in vLLM,
    # any temperature below 1e-5 is greedy instead.
    torch.manual_seed(70)
    logits = torch.randn(2, 32) * 3
    seqs = [make_seq(SamplingOptions(temperature=temperature), key=f"r{i}") for i in range(2)]
    probs = filtered_probs(logits, [s.options for s in seqs])
    assert probs.isnan().any(dim=-1).tolist() == [False, False], "NaN probabilities"
    assert sample(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


# What a request allows: logit bias, min_tokens, a grammar's mask --------------------------------------------

EOS = frozenset({2})
VOCAB = 49152


def test_a_bias_moves_the_argmax_and_the_logprobs_stay_raw() -> None:
    """A bias is added to the logit (vLLM's meaning), not put in its place: 7 gains 5 and passes 3, which
    loses 1; 8 gains 5 too but stays below 3 (as the bias alone, 8 would tie with 7)."""
    logits = torch.zeros(3, 10)
    logits[:, 3], logits[:, 7], logits[:, 8] = 1.0, -2.0, -4.5
    options = SamplingOptions(temperature=0.0, logprobs=1, logit_bias=((7, 5.0), (3, -1.0)))
    held = SamplingOptions(temperature=0.0, logit_bias=((8, 5.0),))
    seqs = [make_seq(options, key="biased"), make_seq(SamplingOptions(temperature=0.0), key="free")]
    samples = sample(logits, [*seqs, make_seq(held, key="held")], EOS)
    assert samples.token_ids == [7, 3, 3]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert samples.logprobs[0] is not None and abs(samples.logprobs[0].logprob - float(raw[7])) < 1e-6


def test_min_tokens_holds_back_eos_and_stop_tokens_until_then() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2], logits[0, 5], logits[0, 4] = 9.0, 8.0, 1.0  # EOS, then a stop token, then a word
    options = SamplingOptions(temperature=0.0, min_tokens=3, stop_token_ids=(5,))
    assert sample(logits, [make_seq(options, output=(4, 4))], EOS).token_ids == [4]  # 2 out: held back
    assert sample(logits, [make_seq(options, output=(4, 4, 4))], EOS).token_ids == [2]  # 3 out: free
    # With ignore_eos, EOS ends nothing, so it is not held back; the stop token still is.
    ignoring = SamplingOptions(temperature=0.0, min_tokens=3, stop_token_ids=(5,), ignore_eos=True)
    assert sample(logits, [make_seq(ignoring)], EOS).token_ids == [2]
    logits[0, 2] = -9.0
    assert sample(logits, [make_seq(ignoring)], EOS).token_ids == [4]


def test_a_zero_in_the_seeded_noise_does_not_pick_its_token() -> None:
    """seeded_noise(9, 35, ...) is exactly 0 at token 31966: p / 0 would make it win whatever p is."""
    assert float(seeded_noise(9, 35, VOCAB)[31966]) == 0.0
    logits = torch.zeros(1, VOCAB)
    logits[0, :5] = 20.0  # five likely tokens; 31966 is left with a tiny probability, or none under top_k
    for options in (
        SamplingOptions(temperature=1.0, seed=9),
        SamplingOptions(temperature=1.0, seed=9, top_k=5),
    ):
        seq = make_seq(options, prompt=list(range(35)))
        assert sample(logits, [seq], EOS).token_ids[0] < 5


def test_a_grammar_masks_its_row_alone_and_a_dead_end_is_reported(tokenizer: PreTrainedTokenizerBase) -> None:
    torch.manual_seed(0)
    constraint = Constraint("choice", choices=("yes", "no way"))
    choice = make_seq(SamplingOptions(temperature=0.0, structured=constraint))
    choice.grammar = Grammars(tokenizer, VOCAB, EOS).state(constraint)
    free = make_seq(SamplingOptions(temperature=0.0), key="free")
    while not choice.grammar.terminated:
        logits = torch.randn(2, VOCAB)
        samples = sample(logits, [choice, free], EOS)
        assert samples.token_ids[1] == int(logits[1].argmax()) and not samples.dead_ends
        assert choice.grammar.accept(samples.token_ids[0])
        choice.tokens.append(samples.token_ids[0])
    assert choice.tokens[-1] in EOS and tokenizer.decode(choice.output_ids[:-1]) in constraint.choices
    # A grammar whose only next token is EOS, with min_tokens holding EOS back: no token fits. With
    # ignore_eos too, since EOS still ends a constrained row.
    ended = []
    for ignore_eos in (False, True):
        options = SamplingOptions(temperature=0.0, min_tokens=9, ignore_eos=ignore_eos, structured=constraint)
        ended.append(make_seq(options, key=f"ended {ignore_eos}"))
        ended[-1].grammar = Grammars(tokenizer, VOCAB, EOS).state(constraint)
        for token in tokenizer.encode("yes"):
            assert ended[-1].grammar.accept(token)
            ended[-1].tokens.append(token)
    assert sample(torch.randn(3, VOCAB), [*ended, free], EOS).dead_ends == {0, 1}


def test_masks_filled_ahead_sample_as_masks_filled_inline(tokenizer: PreTrainedTokenizerBase) -> None:
    """What the runner does with overlap_grammar: fill the masks while the model runs, then sample."""
    torch.manual_seed(1)
    constraint = Constraint("regex", "[a-z]{3,9}")
    seqs = [
        make_seq(SamplingOptions(temperature=0.9, seed=s, structured=constraint), key=f"r{s}")
        for s in range(4)
    ]
    for seq in seqs:
        seq.grammar = Grammars(tokenizer, VOCAB, EOS).state(constraint)
    logits = torch.randn(4, VOCAB)
    ahead = fill_masks([seq.grammar for seq in seqs], VOCAB)
    assert ahead is not None and fill_masks([None, None], VOCAB) is None
    assert sample(logits, seqs, EOS, ahead).token_ids == sample(logits, seqs, EOS).token_ids
