"""Benchmark workloads: the requests (prompt token ids, output lengths) and when each one arrives."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tokenizers import Tokenizer

WorkloadName = Literal["fixed", "random", "shared-prefix"]


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool  # True makes the output exactly max_tokens long
    arrival: float  # seconds after the start; 0 for everyone under a fixed concurrency
    prompt_text: str | None = None  # the prompt as text, for a server that takes no token ids


@dataclass(frozen=True)
class WorkloadSpec:
    name: WorkloadName
    input_len: tuple[int, int]  # inclusive range of prompt lengths (of the suffix, for shared-prefix)
    output_len: tuple[int, int]
    prefix_len: int = 0  # the shared system prompt's length, for shared-prefix

    @classmethod
    def named(
        cls,
        name: WorkloadName,
        input_len: tuple[int, int] | None = None,
        output_len: tuple[int, int] | None = None,
        prefix_len: int | None = None,
    ) -> WorkloadSpec:
        """The workload's defaults, with any of them overridden."""
        defaults = {
            # The source document's: 512 tokens in, up to 1024 out (the model may stop earlier).
            "fixed": cls("fixed", (512, 512), (1024, 1024)),
            "random": cls("random", (64, 512), (16, 512)),
            "shared-prefix": cls("shared-prefix", (16, 128), (16, 128), prefix_len=1024),
        }[name]
        return cls(
            name,
            input_len or defaults.input_len,
            output_len or defaults.output_len,
            defaults.prefix_len if prefix_len is None else prefix_len,
        )


def make_requests(
    spec: WorkloadSpec,
    count: int,
    *,
    vocab: Sequence[int],
    rate: float | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """count requests of random token ids drawn from vocab; Poisson arrivals at rate per second, if given."""
    rng = random.Random(seed)
    prefix = [rng.choice(vocab) for _ in range(spec.prefix_len)]
    arrival = 0.0
    requests = []
    for index in range(count):
        prompt = prefix + [rng.choice(vocab) for _ in range(rng.randint(*spec.input_len))]
        requests.append(
            BenchRequest(
                index=index,
                prompt_ids=prompt,
                max_tokens=rng.randint(*spec.output_len),
                ignore_eos=spec.name != "fixed",
                arrival=arrival,
            )
        )
        if rate is not None:
            arrival += rng.expovariate(rate)
    return requests


def word_tokens(tokenizer: Tokenizer) -> list[int]:
    """The ids of whole ASCII words with a leading space (" cat"). A prompt made of them decodes to text that
    encodes back to the same ids, since the pre-tokenizer cuts the text at each space: a server that
    tokenizes the text itself sees exactly the tokens another server gets as ids."""
    texts = [tokenizer.decode([token_id]) for token_id in range(tokenizer.get_vocab_size())]
    words = [
        i for i, text in enumerate(texts) if text[:1] == " " and text[1:].isascii() and text[1:].isalpha()
    ]
    encoded = tokenizer.encode_batch([texts[i] for i in words], add_special_tokens=False)
    return [token_id for token_id, one in zip(words, encoded, strict=True) if one.ids == [token_id]]


def with_text(requests: list[BenchRequest], tokenizer: Tokenizer) -> list[BenchRequest]:
    """The requests with their prompts as text too; refuses a prompt whose text would tokenize otherwise."""
    texted = []
    for request in requests:
        text = tokenizer.decode(request.prompt_ids)
        if tokenizer.encode(text, add_special_tokens=False).ids != request.prompt_ids:
            raise ValueError(f"request {request.index}'s prompt does not survive decoding and encoding")
        texted.append(dataclasses.replace(request, prompt_text=text))
    return texted
