"""Batched sampling in torch, with vLLM's meanings.

Per row, in order: what the request allows (its logit bias; EOS and stop tokens held back until
min_tokens; its grammar's mask), penalties (repetition over prompt and output, presence and frequency over
the output), temperature, min_p, then top_k and top_p. Greedy rows take the argmax of the penalized logits.
Random rows draw by the exponential race, argmax(p / E) with E ~ Exp(1), which samples from p exactly. A
seeded row's noise is a function of its seed and the token's position alone (`seeded_noise`: a Philox
counter-based generator keyed by all 64 bits of the seed), so its tokens depend neither on what else is
in the batch nor on which worker, or how many times, runs the request. Log-probabilities are the model's
own (before penalties and temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common.sampling import SamplingOptions
from services.worker.core.batch import to_device, to_host
from services.worker.core.grammar import mask_logits
from services.worker.core.sequence import Sequence, TokenLogprob


@dataclass(frozen=True)
class Samples:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows that did not ask
    dead_ends: frozenset[int] = frozenset()  # rows whose grammar allowed no token: their token is meaningless


@dataclass(frozen=True)
class Draw:
    """A batch's chosen tokens and their log-probabilities, on their way from the device to the host:
    `samples` waits for them; until then, `tokens` can feed the next step on the device."""

    tokens: torch.Tensor  # [S], on the device
    logprob_rows: list[int]  # the rows that asked for log-probabilities, and how many top tokens each
    tops: list[int]
    dead_ends: frozenset[int]
    _host: tuple[torch.Tensor, ...]  # tokens, then the asking rows' chosen, top values and top ids
    _ready: torch.cuda.Event | None  # recorded after the copies to _host

    def samples(self) -> Samples:
        if self._ready is not None:
            self._ready.synchronize()
        token_ids = self._host[0].tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.logprob_rows:
            asked = [token_ids[row] for row in self.logprob_rows]
            chosen, top_values, top_ids = self._host[1:]
            for row, logprob in zip(
                self.logprob_rows, _token_logprobs(asked, chosen, top_values, top_ids, self.tops), strict=True
            ):
                logprobs[row] = logprob
        return Samples(token_ids, logprobs, self.dead_ends)


def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_token_ids: frozenset[int] = frozenset(),
    masks: torch.Tensor | None = None,
) -> Samples:
    """Pick one token per row of logits [S, V] (fp32) for the matching sequence, and wait for them."""
    return draw(logits, seqs, eos_token_ids, masks).samples()


def draw(
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_token_ids: frozenset[int] = frozenset(),
    masks: torch.Tensor | None = None,
    prefixes: list[tuple[int, ...]] | None = None,
) -> Draw:
    """Pick one token per row of logits [S, V] (fp32) for the matching sequence, with no wait for the device
    (unless a row's grammar or penalties need the host); masks: the rows' grammar masks, if already filled
    (`grammar.fill_masks`; a draft's rows need them); prefixes: the drafted tokens that each row's token
    follows past its sequence's end (`speculation`), none if None: the row draws as a step without
    speculation would once they were the sequence's."""
    options = [seq.options for seq in seqs]
    prefixes = prefixes or [()] * len(seqs)
    raw = logits
    dead_ends: list[int] = []
    if any(o.logit_bias or o.min_tokens for o in options) or any(seq.grammar for seq in seqs):
        logits = logits.clone()
        dead_ends = restrict(logits, seqs, eos_token_ids, masks, prefixes)
    if any(o.penalized for o in options):
        logits = apply_penalties(logits if logits is not raw else logits.clone(), seqs, prefixes)
    greedy = logits.argmax(dim=-1)
    if all(o.greedy for o in options):
        chosen = greedy
    else:
        probs = filtered_probs(logits, options)
        noise = torch.empty_like(probs).exponential_()
        for row, (seq, prefix) in enumerate(zip(seqs, prefixes, strict=True)):
            if seq.options.seed is not None and not seq.options.greedy:
                position = seq.num_tokens + len(prefix)
                noise[row] = to_device(
                    seeded_noise(seq.options.seed, position, noise.shape[1]), noise.dtype, noise
                )
        # A float32 draw of exactly 0 (about 1 in 10^7 for each token) would make p / E infinite, or NaN
        # for a token of probability 0: it counts as the smallest draw that a 24-bit uniform gives.
        drawn = (probs / noise.clamp_min_(2.0**-24)).argmax(dim=-1)
        chosen = torch.where(to_device([o.greedy for o in options], torch.bool, logits), greedy, drawn)
    rows = [row for row, o in enumerate(options) if o.logprobs]
    tops = [options[row].logprobs for row in rows]
    scores: tuple[torch.Tensor, ...] = ()
    if rows:
        at = to_device(rows, torch.long, raw)
        scores = logprobs_of(raw.index_select(0, at), chosen.index_select(0, at), max(tops))
    host, ready = to_host(chosen, *scores)
    return Draw(chosen, rows, tops, frozenset(dead_ends), host, ready)


def restrict(
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_token_ids: frozenset[int],
    masks: torch.Tensor | None = None,
    prefixes: list[tuple[int, ...]] | None = None,
) -> list[int]:
    """Apply, in place, each row's logit bias, min_tokens' hold-back and grammar; returns the rows that allow
    no token. prefixes: as `draw`'s."""
    biased = [(row, token, bias) for row, seq in enumerate(seqs) for token, bias in seq.options.logit_bias]
    if biased:  # one scatter for the whole batch
        rows, tokens, values = zip(*biased, strict=True)
        index = (to_device(rows, torch.long, logits), to_device(tokens, torch.long, logits))
        logits.index_put_(index, to_device(values, logits.dtype, logits), accumulate=True)
    for row, (seq, prefix) in enumerate(zip(seqs, prefixes or [()] * len(seqs), strict=True)):
        o = seq.options
        if seq.num_tokens + len(prefix) - seq.prompt_len < o.min_tokens:
            # EOS ends a constrained row whatever ignore_eos says, so min_tokens holds it back there too.
            ends = eos_token_ids if not o.ignore_eos or seq.grammar is not None else frozenset()
            held = to_device(sorted(set(o.stop_token_ids) | ends), torch.long, logits)
            logits[row].index_fill_(0, held, -torch.inf)
    return mask_logits(logits, [seq.grammar for seq in seqs], masks)


def apply_penalties(
    logits: torch.Tensor, seqs: list[Sequence], prefixes: list[tuple[int, ...]] | None = None
) -> torch.Tensor:
    """Penalize, in place, the rows whose sequences ask for it; prefixes: as `draw`'s, output too."""
    vocab = logits.shape[1]
    for row, (seq, prefix) in enumerate(zip(seqs, prefixes or [()] * len(seqs), strict=True)):
        o = seq.options
        if not o.penalized:
            continue
        output = torch.tensor([*seq.output_ids, *prefix], dtype=torch.long, device=logits.device)
        counts = torch.zeros(vocab, device=logits.device).index_add_(
            0, output, torch.ones(len(output), device=logits.device)
        )
        if o.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(seq.tokens[: seq.prompt_len], dtype=torch.long, device=logits.device)] = True
            x = logits[row]
            penalized = torch.where(x > 0, x / o.repetition_penalty, x * o.repetition_penalty)
            logits[row] = torch.where(seen, penalized, x)
        logits[row] -= o.frequency_penalty * counts + o.presence_penalty * (counts > 0).float()
    return logits


def filtered_probs(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """Probabilities after temperature, min_p, top_k and top_p; removed tokens have probability 0."""
    temperature = to_device([1.0 if o.greedy else o.temperature for o in options], logits.dtype, logits)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if not any(o.filtered for o in options):
        return probs
    vocab = probs.shape[1]
    min_p = to_device([o.min_p for o in options], probs.dtype, probs)
    probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    top_k = to_device([o.top_k if 0 < o.top_k < vocab else vocab for o in options], torch.long, probs)
    top_p = to_device([o.top_p for o in options], probs.dtype, probs)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    sorted_probs = sorted_probs.masked_fill(rank >= top_k[:, None], 0.0)
    # top_p keeps the smallest prefix of what top_k left whose mass reaches top_p; the first token stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    threshold = torch.where(top_p < 1.0, top_p, torch.inf)[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
    drop = mass_before >= threshold
    drop[:, 0] = False
    return probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))


def seeded_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [vocab] for the token at `position` of a request with this seed."""
    # Philox's counter has four 64-bit words; the position takes the second, so each position's stream
    # has 2^64 draws of its own before it could meet the next one's.
    bits = np.random.Philox(key=seed & (2**64 - 1), counter=[0, position, 0, 0])
    return torch.from_numpy(np.random.Generator(bits).standard_exponential(vocab, dtype=np.float32))


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's log-probability of its token, and the n best (values, then ids), from logits [R, V]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    top_values, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], logprobs[:, :0].long())
    return chosen, top_values, top_ids


def score(logits: torch.Tensor, token_ids: list[int], tops: list[int]) -> list[TokenLogprob]:
    """Each row's log-probability of its token, and its top-n with n from tops, from logits [R, V]."""
    chosen, top_values, top_ids = logprobs_of(logits, to_device(token_ids, torch.long, logits), max(tops))
    return _token_logprobs(token_ids, chosen, top_values, top_ids, tops)


def _token_logprobs(
    token_ids: list[int],
    chosen: torch.Tensor,
    top_values: torch.Tensor,
    top_ids: torch.Tensor,
    tops: list[int],
) -> list[TokenLogprob]:
    """TokenLogprobs from the host copies of logprobs_of's results."""
    chosen_list, values, ids = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(token, logprob, tuple(zip(ids[i][:k], values[i][:k], strict=True)))
        for i, (token, logprob, k) in enumerate(zip(token_ids, chosen_list, tops, strict=True))
    ]
