"""The engine's settings (the worker's --max-batched-tokens, --speculative, ...): apart from the engine, which
imports torch, so that the worker's settings (and `pagedserve up`, which reads them) load without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedserve.plumbing.settings import between, check_settings, positive, setting


@dataclass(frozen=True)
class EngineConfig:
    max_batched_tokens: int = setting(
        1024, "tokens a step, prefill chunks and decodes together; trades TTFT against TPOT", check=positive
    )
    max_num_seqs: int = setting(64, "sequences running at once", check=positive)
    prefix_caching: bool = setting(True, "look prompts up in the prefix cache, and publish full pages")
    # Off by default: on a CPU the model's threads already take every core (scripts/bench_structured.py).
    overlap_grammar: bool = setting(False, "fill structured outputs' token masks while the model runs")
    async_scheduling: Literal["auto", "on", "off"] = setting(
        "auto",
        "schedule and launch the next step while the device runs this one: auto is on for CUDA; on a CPU, "
        "where the model runs on the engine's own thread, it would only hold each token back a step",
    )
    speculative: Literal["off", "ngram", "draft"] = setting(
        "off",
        "speculative decoding: ngram drafts a decode's next tokens from earlier tokens of its own (prompt "
        "lookup), draft has --draft-model draft them; the decode's step checks them, and the tokens are the "
        "same as with off",
    )
    num_speculative_tokens: int = setting(
        4, "the longest draft --speculative checks in one step", check=between(1, 16)
    )

    def __post_init__(self) -> None:
        check_settings(self)
