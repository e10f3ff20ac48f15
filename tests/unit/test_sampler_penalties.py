"""The batched sampler's repetition, frequency and presence penalties against vLLM's meanings, and
per-request seeds that make a row independent of its batch.

Every test seeds torch itself, so the random logits and the sampler's own noise are reproducible. The
references (tests/unit/sampling.py) are plain Python loops over lists (float64), independent of the
sampler's tensor code.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.common.sampling import SamplingOptions
from services.worker.core.sampler import apply_penalties, sample, seeded_noise
from services.worker.core.sequence import Sequence
from tests.unit.sampling import make_seq, reference_penalties

# 4. Penalties -------------------------------------------------------------------------------------------


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


# 5. Per-request seeds -----------------------------------------------------------------------------------

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
