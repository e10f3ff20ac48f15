"""The batched sampler against straightforward references of vLLM's SamplingParams meanings: greedy rows,
top_k, top_p and min_p filtering, the distribution it draws from, and tiny temperatures.

Every test seeds torch itself, so the random logits and the sampler's own noise are reproducible. The
references (tests/unit/sampling.py) are plain Python loops over lists (float64), independent of the
sampler's tensor code.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence as Seq

import pytest
import torch

from services.common.sampling import SamplingOptions
from services.worker.core.sampler import filtered_probs, sample
from tests.unit.sampling import (
    boundary_margin,
    copies,
    log_probs_of,
    make_seq,
    reference_allowed,
    softmax_list,
)

# 1. Greedy ----------------------------------------------------------------------------------------------


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


# 2. Filtering: top_k, top_p, min_p -----------------------------------------------------------------------

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


# 3. The distribution ------------------------------------------------------------------------------------


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


# Tiny temperatures ---------------------------------------------------------------------------------------


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
