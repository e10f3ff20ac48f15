"""Benchmark workloads: the requests (prompt token ids, output lengths) and when each one arrives."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

WorkloadName = Literal["fixed", "random", "shared-prefix"]


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool  # True makes the output exactly max_tokens long
    arrival: float  # seconds after the start; 0 for everyone under a fixed concurrency


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
    vocab: range,
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
