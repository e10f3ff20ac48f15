"""What a request allows before it samples: logit bias, min_tokens' hold-back of EOS and stop tokens, and a
grammar's mask; and a seeded draw whose noise is exactly zero somewhere, which must not pick that token."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from services.common.sampling import SamplingOptions
from services.common.structured import Constraint
from services.worker.core.grammar import Grammars, fill_masks
from services.worker.core.sampler import sample, seeded_noise
from tests.unit.sampling import make_seq

EOS = frozenset({2})
VOCAB = 49152


def test_a_bias_moves_the_argmax_and_the_logprobs_stay_raw() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 3] = 1.0
    options = SamplingOptions(temperature=0.0, logprobs=1, logit_bias=((7, 5.0), (3, -5.0)))
    seqs = [make_seq(options, key="biased"), make_seq(SamplingOptions(temperature=0.0), key="free")]
    samples = sample(logits, seqs, EOS)
    assert samples.token_ids == [7, 3]
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
    # A grammar whose only next token is EOS, with min_tokens holding EOS back: no token fits.
    ended = make_seq(SamplingOptions(temperature=0.0, min_tokens=9, structured=constraint), key="ended")
    ended.grammar = Grammars(tokenizer, VOCAB, EOS).state(constraint)
    for token in tokenizer.encode("yes"):
        assert ended.grammar.accept(token)
        ended.tokens.append(token)
    assert sample(torch.randn(2, VOCAB), [ended, free], EOS).dead_ends == {0}


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
