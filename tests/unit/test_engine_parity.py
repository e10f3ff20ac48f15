"""The engine core against Hugging Face transformers: token-for-token greedy parity and close logprobs.

Every supported family runs as a small random model: alone, in a batch of different prompt lengths with
chunked prefill, through preemption in a pool too small for the batch, and from the prefix cache; each with
steps run one by one, and with async scheduling (the next step launched before this one's tokens are on the
host). After each run every page is free or cached.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from kernels import KernelBackend, TorchBackend
from kernels.cpu_backend import CpuBackend, cpu_ops
from memory_daemon.shape import PoolShape
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineConfig, EngineCore
from services.worker.core.outputs import RequestOutput
from services.worker.core.sequence import FinishReason
from services.worker.kv.local import LocalKVCache
from services.worker.models import CausalLM
from tests.models import FAMILIES, VOCAB, make_model
from tests.pages import assert_pages_back

NEW_TOKENS = 24
LOGPROB_ATOL = 1e-4  # fp32 on CPU: the engine and transformers differ only in summation order
GREEDY = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass
class Family:
    model: CausalLM
    hf: PreTrainedModel
    scheduling: Literal["on", "off"]  # async scheduling

    def engine(self, num_pages: int = 256, max_batched_tokens: int = 64, page_size: int = 16) -> EngineCore:
        spec = self.model.spec
        shape = PoolShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", page_size)
        kv = LocalKVCache(shape, num_pages)
        return EngineCore(
            self.model,
            kv,
            EngineConfig(
                max_batched_tokens=max_batched_tokens, max_num_seqs=16, async_scheduling=self.scheduling
            ),
        )

    def reference(self, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
        """transformers' greedy tokens and the log-softmax of its logits at each step."""
        out = self.hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
        return out.sequences[0, len(prompt) :].tolist(), logprobs


def backend(name: str) -> KernelBackend:
    if name == "torch":
        return TorchBackend()
    ops = cpu_ops()
    if ops is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    return CpuBackend(ops)


@pytest.fixture(
    scope="module",
    params=[(f, b, s) for s in ("off", "on") for b in ("torch", "cpu") for f in FAMILIES],
    ids=lambda param: "-".join(param[:2]) + ("-async" if param[2] == "on" else ""),
)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name, kernels, scheduling = request.param
    folder = make_model(name, tmp_path_factory.mktemp(name))
    model = CausalLM.from_pretrained(
        folder, dtype=torch.float32, device=torch.device("cpu"), backend=backend(kernels)
    )
    return Family(model, AutoModelForCausalLM.from_pretrained(folder).eval(), scheduling)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def run(
    engine: EngineCore, batch: list[list[int]], options: SamplingOptions = GREEDY
) -> dict[int, list[RequestOutput]]:
    for key, prompt in enumerate(batch):
        engine.add(engine.new_sequence(key, prompt, options))
    outputs: dict[int, list[RequestOutput]] = defaultdict(list)
    for output in engine.run_until_done():
        outputs[output.key].append(output)  # type: ignore[index]
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


@pytest.fixture
def check_pages() -> Iterator[list[EngineCore]]:
    """Engines registered here must end with every page free or cached, and exact books."""
    engines: list[EngineCore] = []
    yield engines
    for engine in engines:
        assert_pages_back(engine.kv)


def test_alone(family: Family, check_pages: list[EngineCore]) -> None:
    for prompt in prompts(1, 16, 37):
        engine = family.engine()
        check_pages.append(engine)
        outputs = run(engine, [prompt])[0]
        assert tokens(outputs) == family.reference(prompt)[0]
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        assert outputs[-1].prompt_tokens == len(prompt)


def test_batch_of_different_lengths_with_chunked_prefill(
    family: Family, check_pages: list[EngineCore]
) -> None:
    batch = prompts(3, 17, 40, 95, seed=1)  # 95 > the budget of 32: prefilled in chunks, beside decodes
    engine = family.engine(max_batched_tokens=32)
    check_pages.append(engine)
    outputs = run(engine, batch)
    for key, prompt in enumerate(batch):
        assert tokens(outputs[key]) == family.reference(prompt)[0], f"prompt {key} ({len(prompt)} tokens)"


def test_preemption_by_recompute(family: Family, check_pages: list[EngineCore]) -> None:
    batch = prompts(30, 33, 36, seed=2)  # each ends near 60 tokens: 4 pages of 16; the pool has 9
    engine = family.engine(num_pages=10, max_batched_tokens=128)
    check_pages.append(engine)
    outputs = run(engine, batch)
    assert engine.scheduler.preemptions > 0
    for key, prompt in enumerate(batch):
        assert tokens(outputs[key]) == family.reference(prompt)[0]


def test_prefix_cache_hit(family: Family, check_pages: list[EngineCore]) -> None:
    (shared,) = prompts(50, seed=3)
    engine = family.engine()
    check_pages.append(engine)
    first = run(engine, [shared])[0]
    follow_up = shared + prompts(9, seed=4)[0]
    second = run(engine, [follow_up])[0]
    assert first[-1].cached_prompt_tokens == 0
    assert second[-1].cached_prompt_tokens == 48  # three full pages of the shared prompt
    assert tokens(second) == family.reference(follow_up)[0]
    again = run(engine, [shared])[0]
    assert again[-1].cached_prompt_tokens == 48  # the last page is left to compute: 50 = 3 * 16 + 2
    assert tokens(again) == tokens(first)
    assert engine.kv.stats().prefix_hits == 2


def test_logprobs_are_close(family: Family, check_pages: list[EngineCore]) -> None:
    (prompt,) = prompts(21, seed=5)
    engine = family.engine()
    check_pages.append(engine)
    options = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = run(engine, [prompt], options)[0]
    expected_tokens, expected = family.reference(prompt)
    assert tokens(outputs) == expected_tokens
    logprobs = [lp for output in outputs for lp in output.logprobs]
    assert len(logprobs) == NEW_TOKENS
    for step, lp in enumerate(logprobs):
        top_values, top_ids = expected[step].topk(5)
        assert [token for token, _ in lp.top] == top_ids.tolist()
        torch.testing.assert_close(
            torch.tensor([value for _, value in lp.top]), top_values, atol=LOGPROB_ATOL, rtol=0
        )
        assert abs(lp.logprob - expected[step, lp.token_id].item()) < LOGPROB_ATOL


def test_stops_at_eos_unless_told_not_to(family: Family, check_pages: list[EngineCore]) -> None:
    (prompt,) = prompts(12, seed=6)
    expected = family.reference(prompt)[0]
    stop_at = expected[5]
    engine = family.engine()
    check_pages.append(engine)
    options = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=(stop_at,))
    outputs = run(engine, [prompt], options)[0]
    assert tokens(outputs) == expected[: expected.index(stop_at) + 1]
    assert outputs[-1].finish_reason is FinishReason.STOP
