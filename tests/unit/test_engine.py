"""The engine core (services.worker.core.engine.EngineCore) on small random models, and its thread facade
(services.worker.core.loop.Engine).

Sections:

- The thread facade: a step that runs far longer than the steps before it counts as stuck.
- Parity with transformers: token-for-token greedy parity and close logprobs. Every supported family runs
  as a small random model: alone, in a batch of different prompt lengths with chunked prefill, through
  preemption in a pool too small for the batch, from the prefix cache, and resumed with the tokens it had
  before a failover; each with steps run one by one,
  and with async scheduling (the next step launched before this one's tokens are on the host). After each
  run every page is free or cached.
- A resumed request: one resumed with the tokens it generated elsewhere (a failover) goes on exactly as if
  uninterrupted: penalties count those tokens as output, a seeded draw depends on the position alone,
  max_tokens counts them, and the full pages it published are found in the prefix cache.
- Async scheduling: the next step is scheduled and launched before this one's tokens reach the host. On
  the CPU the device work is done by the time `launch` returns, so these tests check the bookkeeping, not
  the overlap: the same tokens as steps run one by one, for every kind of request; no row spent on a
  request whose last token is already on its way; and pages that a launched step may still write are given
  back only once it is done, whether its request stopped, was aborted, or was preempted.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from memory_daemon.prefix import page_keys, salted_root
from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops
from pagedserve.kernels.cpu_features import cpu_features
from pagedserve.kernels.torch_ref import TorchBackend
from pagedserve.plumbing.errors import InvalidArgument, ResourceExhausted
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineCore
from services.worker.core.engine_config import EngineConfig
from services.worker.core.loop import Engine
from services.worker.core.model_runner import StepInFlight
from services.worker.core.scheduler import ScheduledSeq
from services.worker.core.sequence import FinishReason, RequestOutput
from services.worker.kv.local import LocalKVCache
from services.worker.models import CausalLM, load_model
from tests.models import FAMILIES, VOCAB, make_model
from tests.pages import assert_pages_back
from tests.waiting import wait_until

# The thread facade: a stuck step ----------------------------------------------------------------------------


def test_a_step_stuck_past_the_floor_is_reported_and_clears_when_it_ends(tmp_path: Path) -> None:
    folder = make_model("llama", tmp_path / "model")
    cpu = torch.device("cpu")
    model = load_model(folder, dtype=torch.float32, device=cpu, backend=TorchBackend())
    spec = model.spec
    kv = LocalKVCache(spec.pool_shape("float32", 16), 64)
    core = EngineCore(model, kv, EngineConfig())
    loop = Engine(core)
    release = threading.Event()
    real_step = core.step

    def stuck_step() -> list:
        release.wait(30)
        return real_step()

    loop.start()
    try:
        assert loop.stalled(floor_s=0.2) is None  # idle is not stuck
        with mock.patch.object(core, "step", stuck_step):
            loop.submit("r", EngineRequest((5, 6, 7), SamplingOptions(max_tokens=2, temperature=0.0)))
            why = wait_until(lambda: loop.stalled(floor_s=0.2), 10, "the stuck step to be noticed")
            assert why.startswith("the engine has been in one step for")
            release.set()
            wait_until(lambda: loop.stalled(floor_s=0.2) is None, 10, "the step to end")
    finally:
        release.set()
        loop.stop()


# Parity with transformers -----------------------------------------------------------------------------------

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
        shape = spec.pool_shape("float32", page_size)
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
    """torch: the reference; cpu: the C++ kernels without bfloat16 arithmetic; cpu-worker: the C++
    kernels with the instructions the worker would use on this CPU (vdpbf16ps where it ran:
    pagedserve/kernels/cpu_features.py)."""
    if name == "torch":
        return TorchBackend()
    ops = cpu_ops()
    if ops is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    return CpuBackend(ops, cpu_features() if name == "cpu-worker" else None)


@pytest.fixture(
    scope="module",
    params=[(f, b, s) for s in ("off", "on") for b in ("torch", "cpu") for f in FAMILIES],
    ids=lambda param: "-".join(param[:2]) + ("-async" if param[2] == "on" else ""),
)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name, kernels, scheduling = request.param
    folder = make_model(name, tmp_path_factory.mktemp(name))
    model = load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=backend(kernels))
    return Family(
        model, AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval(), scheduling
    )


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def run(
    engine: EngineCore, batch: list[list[int]], options: SamplingOptions = GREEDY
) -> dict[int, list[RequestOutput]]:
    for key, prompt in enumerate(batch):
        engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), options)))
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
    # A model whose every layer slides holds at most 3 of them a sequence: the pool has 5. One with full and
    # sliding layers has a block table for each of its G groups of layers: the first two prompts' 5 G
    # pages fill its pool, and the first to need a page takes the second's.
    spec = family.model.spec
    groups = spec.kv_groups.count
    num_pages = 6 if all(spec.windows) else 10 if groups == 1 else 1 + 5 * groups
    engine = family.engine(num_pages=num_pages, max_batched_tokens=128)
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
    assert engine.kv.stats().prefix_hits == 2 * family.model.spec.kv_groups.count  # a lookup a group


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


def test_stops_at_a_stop_token_id(family: Family, check_pages: list[EngineCore]) -> None:
    """The stop token ends the stream, included, as in transformers' greedy tokens (EOS and ignore_eos:
    test_scheduler's stop rules)."""
    (prompt,) = prompts(12, seed=6)
    expected = family.reference(prompt)[0]
    stop_at = expected[5]
    engine = family.engine()
    check_pages.append(engine)
    options = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=(stop_at,))
    outputs = run(engine, [prompt], options)[0]
    assert tokens(outputs) == expected[: expected.index(stop_at) + 1]
    assert outputs[-1].finish_reason is FinishReason.STOP


def test_a_request_resumed_after_a_failover_goes_on_exactly(
    family: Family, check_pages: list[EngineCore]
) -> None:
    """What a worker does for a request the frontend moves to it: the tokens so far come with it."""
    (prompt,) = prompts(40, seed=9)
    expected = family.reference(prompt)[0]
    engine = family.engine()
    check_pages.append(engine)
    resumed = EngineRequest(tuple(prompt), GREEDY, generated=tuple(expected[:9]))
    engine.add(engine.new_sequence(0, resumed))
    assert tokens(engine.run_until_done()) == expected[9:]


@pytest.mark.parametrize("name", ["phi3-longrope", "phi3-longrope-partial"])
@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_long_rope_past_the_original_context(
    name: str, kernels: str, tmp_path: Path, check_pages: list[EngineCore]
) -> None:
    """Phi-3's long factors, for prompts longer than its original context of 64, alone and in one batch; and
    Phi-4-mini's, over part of each head."""
    folder = make_model(name, tmp_path)
    model = load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=backend(kernels))
    family = Family(model, AutoModelForCausalLM.from_pretrained(folder).eval(), "off")
    batch = prompts(70, 100, 130, seed=7)
    engine = family.engine(max_batched_tokens=128)
    check_pages.append(engine)
    outputs = run(engine, batch)
    for key, prompt in enumerate(batch):
        assert tokens(outputs[key]) == family.reference(prompt)[0], f"prompt {key} ({len(prompt)} tokens)"


@pytest.mark.parametrize(
    ("name", "windows"),
    [("mistral-window", (28,)), ("gemma2-softcap", (0, 24)), ("gemma3-local-global", (0, 20, 20))],
)
@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("scheduling", ["off", "on"])
def test_sliding_layers_give_back_the_pages_before_their_window(
    name: str,
    windows: tuple[int, ...],
    kernels: str,
    scheduling: Literal["on", "off"],
    tmp_path: Path,
    check_pages: list[EngineCore],
) -> None:
    """Decoding to 220 tokens, the block table of each group of sliding layers (windows of 20 to 28 tokens)
    holds 3 pages of 16 at most (the window's, and the one its next token goes to), and that of each group of
    full layers all 14; the tokens stay transformers'. mistral-window's layers all slide (one group); Gemma
    2's alternate (a group of each), and Gemma 3's are sliding, full, sliding (three groups of one layer).
    (A prefill chunk holds its own pages too, beside the window's.)"""
    folder = make_model(name, tmp_path)
    model = load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=backend(kernels))
    family = Family(model, AutoModelForCausalLM.from_pretrained(folder).eval(), scheduling)
    assert model.spec.kv_groups.windows == windows  # each group's
    (prompt,) = prompts(196, seed=8)
    engine = family.engine(max_batched_tokens=64)
    check_pages.append(engine)
    engine.add(engine.new_sequence(0, EngineRequest(tuple(prompt), GREEDY)))
    outputs, held = [], []
    while engine.has_unfinished():
        outputs += engine.step()
        held += [
            [len(table) - dropped for table, dropped in zip(seq.tables, seq.dropped, strict=True)]
            for seq in engine.scheduler.running
            if seq.num_computed > len(prompt)
        ]
    assert tokens(outputs) == family.reference(prompt)[0]
    most = [max(pages[group] for pages in held) for group in range(len(windows))]
    total = -(-(196 + NEW_TOKENS - 1) // 16)  # the pages of every token but the last, which is not computed
    assert most == [3 if window else total for window in windows]
    assert engine.scheduler.running == [] and engine.kv_slots() == (0, 0)


# A resumed request ------------------------------------------------------------------------------------------

PROMPT = tuple(7 + (i * 37) % (VOCAB - 10) for i in range(21))
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
    model = load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=TorchBackend())
    spec = model.spec
    kv = LocalKVCache(spec.pool_shape("float32", 4), 128)
    return EngineCore(model, kv, EngineConfig(max_batched_tokens=64, max_num_seqs=8))


def generate_resumed(
    engine: EngineCore, options: SamplingOptions, generated: Sequence[int] = ()
) -> list[int]:
    engine.add(engine.new_sequence("r", EngineRequest(PROMPT, options, generated=tuple(generated))))
    tokens = [token for output in engine.run_until_done() for token in output.token_ids]
    assert_pages_back(engine.kv)
    return tokens


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("cut", [1, 9, 23])
def test_a_resumed_request_goes_on_as_if_uninterrupted(engine: EngineCore, name: str, cut: int) -> None:
    options = OPTIONS[name]
    whole = generate_resumed(engine, options)
    assert len(whole) == options.max_tokens
    hits = engine.kv.stats().prefix_hit_pages
    assert generate_resumed(engine, options, whole[:cut]) == whole[cut:]
    # The pages of the prompt and the tokens before the cut (4 tokens a page) come from the prefix cache.
    assert engine.kv.stats().prefix_hit_pages - hits == (len(PROMPT) + cut - 1) // 4


def test_resumed_tokens_are_checked(engine: EngineCore) -> None:
    options = OPTIONS["greedy"]
    with pytest.raises(InvalidArgument, match="max_tokens is reached"):
        engine.new_sequence("r", EngineRequest(PROMPT, options, generated=(5,) * options.max_tokens))
    with pytest.raises(InvalidArgument, match=f"generated_token_ids holds {VOCAB}, which is not a token"):
        engine.new_sequence("r", EngineRequest(PROMPT, options, generated=(VOCAB,)))
    with pytest.raises(ResourceExhausted):
        engine.new_sequence(
            "r", EngineRequest(PROMPT, options, generated=(5,) * engine.model.spec.max_model_len)
        )


# Async scheduling -------------------------------------------------------------------------------------------

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
    return load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=TorchBackend())


def make_engine(model: CausalLM, scheduling: str, num_pages: int = 128, page_size: int = 4) -> EngineCore:
    spec = model.spec
    kv = LocalKVCache(spec.pool_shape("float32", page_size), num_pages)
    config = EngineConfig(max_batched_tokens=32, max_num_seqs=8, async_scheduling=scheduling)  # type: ignore[arg-type]
    return EngineCore(model, kv, config)


class Launches:
    """Records each launch: how many rows it sampled, and whether the step before was still in flight."""

    def __init__(self, engine: EngineCore) -> None:
        self.rows: list[int] = []
        self.ahead = 0
        launch = engine.runner.launch

        def recorded(
            items: list[ScheduledSeq], number: int, previous: StepInFlight | None = None
        ) -> StepInFlight:
            self.ahead += previous is not None
            step = launch(items, number, previous)
            self.rows.append(len(step.sampled))
            return step

        engine.runner.launch = recorded  # type: ignore[method-assign]


def rounded(top: tuple[tuple[int, float], ...]) -> list[tuple[int, float]]:
    """A batch of another size may sum in another order: log-probabilities agree to about 1e-6."""
    return [(token, round(logprob, 4)) for token, logprob in top]


def generate(engine: EngineCore, options: SamplingOptions) -> dict[int, tuple[list[int], list, str]]:
    for key, prompt in enumerate(PROMPTS):
        engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), options)))
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
    engine.add(engine.new_sequence("r", EngineRequest(tuple(PROMPTS[1]), stop)))
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
    engine.add(engine.new_sequence("r", EngineRequest(tuple(PROMPTS[2]), KINDS["greedy"])))
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
    engine.runner.wait_for_device = lambda: waits.append(engine.scheduler.launched)  # type: ignore[method-assign]
    assert generate(engine, KINDS["greedy"]) == generate(one_by_one, KINDS["greedy"])
    assert waits and one_by_one.scheduler.preemptions > 0
    # A request whose last token is on its way holds its pages a step longer, so the pool runs dry sooner.
    assert engine.scheduler.preemptions >= one_by_one.scheduler.preemptions


def test_a_new_request_warms_the_keys_its_lookup_will_ask_for(model: CausalLM) -> None:
    """As a request arrives (new_sequence, on the caller's thread), the pool is asked to bring back from a
    lower tier the pages the scheduler's lookup will want: every full page but the last token's, the
    request's salt in the chain; none without prefix caching, nor from a pool with no lower tier."""
    engine = make_engine(model, "off")
    warmed: list[list[bytes]] = []
    with mock.patch.object(engine.kv, "warm", side_effect=lambda keys: warmed.append(list(keys))):
        engine.new_sequence(0, EngineRequest(tuple(range(5, 18)), GREEDY))
        assert warmed == []  # the local pool has no lower tier: no keys are hashed for it
        engine.kv.lower_tier = True
        prompt = tuple(range(5, 18))  # 13 tokens: three full pages of 4 before the last token
        seq = engine.new_sequence(0, EngineRequest(prompt, GREEDY, cache_salt="tenant-a"))
        assert warmed == [page_keys(prompt[:12], 4, salted_root("tenant-a"))]  # the daemon's own chain
        assert warmed[0] != page_keys(prompt[:12], 4)  # not the unsalted prompt's
        engine.add(seq)
        engine.run_until_done()
        assert engine.scheduler.cached_prompt_tokens == 0  # the local pool holds nothing yet
        off = EngineCore(model, engine.kv, EngineConfig(prefix_caching=False))
        off.new_sequence(1, EngineRequest(prompt, GREEDY))
        assert len(warmed) == 1


def test_a_salted_prompts_pages_are_published_without_their_tokens(model: CausalLM) -> None:
    """The daemon announces a page to gateways with its tokens (prefix events); a salted prompt's pages
    must go without them, so that only requests with the same salt can tell what they hold. An unsalted
    prompt's go with theirs."""
    engine = make_engine(model, "off")
    published: dict[bytes, list[int]] = {}  # each page's tokens as offered, by its key
    publish = engine.kv.publish

    def spy(keys: Sequence[bytes], pages: Sequence[int], **kwargs: Any) -> int:
        tokens = list(kwargs.get("tokens", ()))
        for i, key in enumerate(keys):
            published[key] = tokens[i * 4 : (i + 1) * 4]
        return publish(keys, pages, **kwargs)

    prompt = tuple(range(5, 18))  # three full pages of 4 before the last token
    with mock.patch.object(engine.kv, "publish", side_effect=spy):
        for salt in ("", "tenant-a"):
            engine.add(engine.new_sequence(salt, EngineRequest(prompt, GREEDY, cache_salt=salt)))
            engine.run_until_done()
    plain = page_keys(prompt[:12], 4)
    salted = page_keys(prompt[:12], 4, salted_root("tenant-a"))
    assert [published[key] for key in plain] == [list(prompt[i : i + 4]) for i in (0, 4, 8)]
    assert [published[key] for key in salted] == [[], [], []]
