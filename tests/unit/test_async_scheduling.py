"""Async scheduling: the next step is scheduled and launched before this one's tokens reach the host.

On the CPU the device work is done by the time `launch` returns, so these tests check the bookkeeping, not
the overlap: the same tokens as steps run one by one, for every kind of request; no row spent on a request
whose last token is already on its way; and pages that a launched step may still write are given back only
once it is done, whether its request stopped, was aborted, or was preempted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels import TorchBackend
from memory_daemon.shape import PoolShape
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineConfig, EngineCore
from services.worker.core.model_runner import StepInFlight
from services.worker.core.plan import ScheduledSeq
from services.worker.kv.local import LocalKVCache
from services.worker.models import CausalLM
from tests.models import VOCAB, make_model
from tests.pages import assert_pages_back

PROMPTS = [
    [3 + (i * step) % (VOCAB - 5) for i in range(length)] for step, length in ((7, 5), (11, 21), (13, 40))
]
KINDS = {
    "greedy": SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True),
    "seeded": SamplingOptions(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
    "logprobs": SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
    "min_tokens": SamplingOptions(max_tokens=12, temperature=0.0, min_tokens=6, logit_bias=((5, 2.0),)),
    "penalized": SamplingOptions(
        max_tokens=12, temperature=0.7, seed=9, repetition_penalty=1.4, frequency_penalty=0.5, ignore_eos=True
    ),
    "prompt_logprobs": SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    folder: Path = make_model("llama", tmp_path_factory.mktemp("llama"))
    return CausalLM.from_pretrained(
        folder, dtype=torch.float32, device=torch.device("cpu"), backend=TorchBackend()
    )


def make_engine(model: CausalLM, scheduling: str, num_pages: int = 128, page_size: int = 4) -> EngineCore:
    spec = model.spec
    kv = LocalKVCache(
        PoolShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", page_size), num_pages
    )
    config = EngineConfig(max_batched_tokens=32, max_num_seqs=8, async_scheduling=scheduling)  # type: ignore[arg-type]
    return EngineCore(model, kv, config)


class Launches:
    """Records each launch: how many rows it sampled, and whether the step before was still in flight."""

    def __init__(self, engine: EngineCore) -> None:
        self.rows: list[int] = []
        self.ahead = 0
        launch = engine.runner.launch

        def recorded(items: list[ScheduledSeq], previous: StepInFlight | None = None) -> StepInFlight:
            self.ahead += previous is not None
            step = launch(items, previous)
            self.rows.append(len(step.sampled))
            return step

        engine.runner.launch = recorded  # type: ignore[method-assign]


def rounded(top: tuple[tuple[int, float], ...]) -> list[tuple[int, float]]:
    """A batch of another size may sum in another order: log-probabilities agree to about 1e-6."""
    return [(token, round(logprob, 4)) for token, logprob in top]


def generate(engine: EngineCore, options: SamplingOptions) -> dict[int, tuple[list[int], list, str]]:
    for key, prompt in enumerate(PROMPTS):
        engine.add(engine.new_sequence(key, prompt, options))
    got: dict[int, list] = defaultdict(list)
    for output in engine.run_until_done():
        got[output.key].append(output)  # type: ignore[index]
    assert_pages_back(engine.kv)
    return {
        key: (
            [t for o in outputs for t in o.token_ids],
            [(lp.token_id, round(lp.logprob, 4), rounded(lp.top)) for o in outputs for lp in o.logprobs]
            + [(lp.token_id, round(lp.logprob, 4)) for o in outputs for lp in o.prompt_logprobs],
            str(outputs[-1].finish_reason),
        )
        for key, outputs in got.items()
    }


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_outputs_as_steps_run_one_by_one(model: CausalLM, kind: str) -> None:
    one_by_one = generate(make_engine(model, "off"), KINDS[kind])
    engine = make_engine(model, "on")
    launches = Launches(engine)
    assert generate(engine, KINDS[kind]) == one_by_one
    if kind in ("greedy", "seeded", "logprobs", "min_tokens"):
        assert launches.ahead > 0.6 * len(launches.rows), "steps were not launched ahead"
    elif kind == "penalized":  # its penalties read the tokens on the host: every step waits for them
        assert launches.ahead == 0


def test_no_row_is_spent_past_max_tokens(model: CausalLM) -> None:
    engine = make_engine(model, "on")
    launches = Launches(engine)
    generate(engine, KINDS["greedy"])
    assert sum(launches.rows) == len(PROMPTS) * 12


def test_a_stop_token_wastes_one_row_and_leaks_no_token(model: CausalLM) -> None:
    reference = generate(make_engine(model, "off"), KINDS["greedy"])[1][0]
    stop = SamplingOptions(max_tokens=12, temperature=0.0, stop_token_ids=(reference[4],))
    engine = make_engine(model, "on")
    launches = Launches(engine)
    engine.add(engine.new_sequence("r", PROMPTS[1], stop))
    outputs = engine.run_until_done()
    assert [t for o in outputs for t in o.token_ids] == reference[: reference.index(reference[4]) + 1]
    assert outputs[-1].finish_reason.value == "stop"  # type: ignore[union-attr]
    assert (
        sum(launches.rows) == reference.index(reference[4]) + 2
    )  # the row launched before the stop was seen
    assert_pages_back(engine.kv)


@pytest.fixture
def running(model: CausalLM) -> Iterator[EngineCore]:
    """An async engine with one request decoding, and a step in flight."""
    engine = make_engine(model, "on")
    engine.add(engine.new_sequence("r", PROMPTS[2], KINDS["greedy"]))
    while engine.generation_tokens < 3:
        engine.step()
    assert engine.has_unfinished() and engine.kv.usage().in_use_pages > 0
    yield engine
    assert_pages_back(engine.kv)


def test_an_aborted_request_keeps_its_pages_until_its_launched_step_is_done(running: EngineCore) -> None:
    held = running.kv.usage().in_use_pages
    output = running.abort("r")
    assert output is not None and output.finish_reason.value == "abort"  # type: ignore[union-attr]
    assert running.kv.usage().in_use_pages == held  # the step in flight may still write them
    assert running.has_unfinished()  # until that step is done
    assert running.step() == []  # its token is dropped
    assert running.kv.usage().in_use_pages == 0
    assert not running.has_unfinished()


def test_abort_all_waits_for_the_step_in_flight_and_takes_every_page_back(running: EngineCore) -> None:
    (output,) = running.abort_all()
    assert output.finish_reason.value == "abort"  # type: ignore[union-attr]
    assert running.kv.usage().in_use_pages == 0 and not running.has_unfinished()


def test_a_dry_pool_first_takes_back_the_pages_a_launched_step_held(model: CausalLM) -> None:
    # 3 prompts of 5, 21 and 40 tokens, 12 more each, in pages of 4: 4 + 9 + 13 = 26 pages at the end.
    engine, one_by_one = make_engine(model, "on", num_pages=24), make_engine(model, "off", num_pages=24)
    waits = []
    engine.scheduler.wait_for_device = lambda: waits.append(engine.scheduler.launched)
    assert generate(engine, KINDS["greedy"]) == generate(one_by_one, KINDS["greedy"])
    assert waits and one_by_one.scheduler.preemptions > 0
    # A request whose last token is on its way holds its pages a step longer, so the pool runs dry sooner.
    assert engine.scheduler.preemptions >= one_by_one.scheduler.preemptions
