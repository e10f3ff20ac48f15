"""The batched sampler's log-probabilities (of the raw model output), and the checks SamplingOptions
makes of its fields.

The log-probability tests seed torch themselves, so the random logits and the sampler's own noise are
reproducible.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.plumbing.errors import InvalidArgument
from services.common.sampling import MAX_LOGPROBS, SamplingOptions
from services.worker.core.sampler import sample
from tests.unit.sampling import make_seq

# 6. Log-probabilities -----------------------------------------------------------------------------------


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


# 7. Validation ------------------------------------------------------------------------------------------


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
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("logprobs", MAX_LOGPROBS),
        ("max_tokens", 1),
        ("seed", -(1 << 63)),
    ],
)
def test_edge_values_are_accepted(field: str, value: float) -> None:
    assert getattr(SamplingOptions(**{field: value}), field) == value
