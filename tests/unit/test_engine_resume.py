"""A request resumed with the tokens it generated elsewhere (a failover) goes on exactly as if uninterrupted:
penalties count those tokens as output, a seeded draw depends on the position alone, max_tokens counts them,
and the full pages it published are found in the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kernels import TorchBackend
from memory_daemon.shape import PoolShape
from pagedserve.plumbing.errors import InvalidArgument, ResourceExhausted
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineConfig, EngineCore
from services.worker.kv.local import LocalKVCache
from services.worker.models import CausalLM
from tests.models import VOCAB, make_model
from tests.pages import assert_pages_back

PROMPT = [7 + (i * 37) % (VOCAB - 10) for i in range(21)]
OPTIONS = {
    "greedy": SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded, penalized": SamplingOptions(
        max_tokens=24,
        temperature=0.9,
        seed=5,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        ignore_eos=True,
    ),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    folder: Path = make_model("llama", tmp_path_factory.mktemp("llama"))
    model = CausalLM.from_pretrained(
        folder, dtype=torch.float32, device=torch.device("cpu"), backend=TorchBackend()
    )
    spec = model.spec
    kv = LocalKVCache(PoolShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", 4), 128)
    return EngineCore(model, kv, EngineConfig(max_batched_tokens=64, max_num_seqs=8))


def generate(engine: EngineCore, options: SamplingOptions, generated: Sequence[int] = ()) -> list[int]:
    engine.add(engine.new_sequence("r", PROMPT, options, generated=generated))
    tokens = [token for output in engine.run_until_done() for token in output.token_ids]
    assert_pages_back(engine.kv)
    return tokens


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("cut", [1, 9, 23])
def test_a_resumed_request_goes_on_as_if_uninterrupted(engine: EngineCore, name: str, cut: int) -> None:
    options = OPTIONS[name]
    whole = generate(engine, options)
    assert len(whole) == options.max_tokens
    hits = engine.kv.stats().prefix_hit_pages
    assert generate(engine, options, whole[:cut]) == whole[cut:]
    # The pages of the prompt and the tokens before the cut (4 tokens a page) come from the prefix cache.
    assert engine.kv.stats().prefix_hit_pages - hits == (len(PROMPT) + cut - 1) // 4


def test_resumed_tokens_are_checked(engine: EngineCore) -> None:
    options = OPTIONS["greedy"]
    with pytest.raises(InvalidArgument, match="max_tokens is reached"):
        engine.new_sequence("r", PROMPT, options, generated=[5] * options.max_tokens)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.new_sequence("r", PROMPT, options, generated=[VOCAB])
    with pytest.raises(ResourceExhausted):
        engine.new_sequence("r", PROMPT, options, generated=[5] * engine.model.spec.max_model_len)
