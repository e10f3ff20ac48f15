"""Benchmark workloads: the requests (prompt token ids, output lengths) and when each one arrives."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tokenizers import Tokenizer

WorkloadName = Literal["fixed", "random", "shared-prefix", "multi-turn", "copy", "chat"]
TEXT_WORKLOADS = ("copy", "chat")  # real text through the chat template (services.bench.texts)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool  # True makes the output exactly max_tokens long
    arrival: float  # seconds after the start; 0 for everyone under a fixed concurrency
    prompt_text: str | None = None  # the prompt as text, for a server that takes no token ids
    session: int | None = None  # multi-turn: the conversation; its turns are sent one after another


@dataclass(frozen=True)
class WorkloadSpec:
    name: WorkloadName
    input_len: tuple[int, int]  # inclusive range of prompt lengths (of the suffix, for shared-prefix)
    output_len: tuple[int, int]
    prefix_len: int = 0  # the shared system prompt's length, for shared-prefix
    turns: int = 1  # multi-turn: the turns of each session (input_len: each turn's new user tokens)

    @classmethod
    def named(
        cls,
        name: WorkloadName,
        input_len: tuple[int, int] | None = None,
        output_len: tuple[int, int] | None = None,
        prefix_len: int | None = None,
        turns: int | None = None,
    ) -> WorkloadSpec:
        """The workload's defaults, with any of them overridden."""
        defaults = {
            # The source document's: 512 tokens in, up to 1024 out (the model may stop earlier).
            "fixed": cls("fixed", (512, 512), (1024, 1024)),
            "random": cls("random", (64, 512), (16, 512)),
            "shared-prefix": cls("shared-prefix", (16, 128), (16, 128), prefix_len=1024),
            # Conversations: each turn sends the whole history, then a reply of about its output's length.
            "multi-turn": cls("multi-turn", (64, 256), (32, 128), turns=6),
            # Text: the prompts are what they are; the output ends at the model's end of turn, or at this.
            "copy": cls("copy", (0, 0), (256, 256)),
            "chat": cls("chat", (0, 0), (256, 256)),
        }[name]
        return cls(
            name,
            input_len or defaults.input_len,
            output_len or defaults.output_len,
            defaults.prefix_len if prefix_len is None else prefix_len,
            turns or defaults.turns,
        )


def make_requests(
    spec: WorkloadSpec,
    count: int,
    *,
    vocab: Sequence[int],
    rate: float | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """count requests of random token ids drawn from vocab; Poisson arrivals at rate per second, if given.
    multi-turn: count sessions of spec.turns requests each (a session's arrival is its first turn's)."""
    rng = random.Random(seed)
    if spec.turns > 1:
        return _sessions(spec, count, vocab, rate, rng)
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


def _sessions(
    spec: WorkloadSpec, count: int, vocab: Sequence[int], rate: float | None, rng: random.Random
) -> list[BenchRequest]:
    """Each turn's prompt is the session's history (every earlier prompt, each followed by a reply of
    random ids as long as that turn's output: the assistant's words as a client sends them back) and new
    user tokens. A server's own output differs from the reply, so what a turn can find cached is the
    previous turn's prompt."""
    requests: list[BenchRequest] = []
    arrival = 0.0
    for session in range(count):
        history: list[int] = []
        for _ in range(spec.turns):
            prompt = history + [rng.choice(vocab) for _ in range(rng.randint(*spec.input_len))]
            max_tokens = rng.randint(*spec.output_len)
            requests.append(BenchRequest(len(requests), prompt, max_tokens, True, arrival, session=session))
            history = prompt + [rng.choice(vocab) for _ in range(max_tokens)]
        if rate is not None:
            arrival += rng.expovariate(rate)
    return requests


def ideal_prefix_hit_rate(requests: list[BenchRequest], page_size: int) -> float | None:
    """The share of prompt tokens a cache that forgets nothing would hold, in full pages: each turn's
    previous prompt (a multi-turn workload's); None for a workload without sessions."""
    last: dict[int, int] = {}  # session -> its previous prompt's length
    cached = 0
    for request in requests:
        if request.session is None:
            return None
        cached += last.get(request.session, 0) // page_size * page_size
        last[request.session] = len(request.prompt_ids)
    return cached / max(1, sum(len(request.prompt_ids) for request in requests))


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
