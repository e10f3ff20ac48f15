"""For the sampler tests: sequences and batches to sample for, and straightforward references of vLLM's
SamplingParams meanings, written as plain Python loops over lists (float64), independent of the sampler's
tensor code.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence as Seq

import torch

from services.common.sampling import SamplingOptions
from services.worker.core.sequence import Sequence


def make_seq(
    options: SamplingOptions, prompt: Seq[int] = (1, 2, 3), output: Seq[int] = (), key: str = "r0"
) -> Sequence:
    return Sequence(
        key=key,
        tokens=[*prompt, *output],
        prompt_len=len(prompt),
        options=options,
        priority=0,
        arrival=0,
    )


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
