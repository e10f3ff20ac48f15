"""The engine core: one step at a time, on the caller's thread: schedule, run the model, postprocess.

With async scheduling a step launches the model on its plan and then postprocesses the step before, which
the device ran while this one was scheduled and built: each step's outputs come from the next call to `step`,
at about the time the device finishes it.
It checks and admits requests, aborts them, and fails them all when the step cannot go on. It knows no
thread (`loop` runs it in one), no gRPC and no protobuf (the servicer converts its outputs). Tests and
benchmarks drive it directly with `add(new_sequence(...))`, `step` and `run_until_done`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Literal, NamedTuple

from memory_daemon.prefix import salted_root
from pagedserve.plumbing.errors import InvalidArgument, ResourceExhausted, StatusError, Unimplemented
from pagedserve.plumbing.settings import check_settings, positive, setting
from services.common.limits import check_prompt_fits
from services.common.sampling import SamplingOptions
from services.worker.core.cuda_graphs import DecodeGraphs
from services.worker.core.grammar import Grammars
from services.worker.core.model_runner import ModelRunner, StepInFlight
from services.worker.core.outputs import RequestOutput
from services.worker.core.plan import Launch
from services.worker.core.scheduler import Scheduler
from services.worker.core.sequence import FinishReason, Sequence
from services.worker.kv.base import KVCache
from services.worker.models import CausalLM

log = logging.getLogger(__name__)


class Launched(NamedTuple):
    """A step on its way through the device: the scheduler's record of it, and the model runner's."""

    launch: Launch
    step: StepInFlight


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

    def __post_init__(self) -> None:
        check_settings(self)


class EngineCore:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        config: EngineConfig,
        graphs: DecodeGraphs | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.grammars = grammars  # compiles structured outputs; None: the engine refuses them
        spec = model.spec
        self.scheduler = Scheduler(
            kv,
            max_batched_tokens=config.max_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            prefix_caching=config.prefix_caching,
            eos_token_ids=spec.eos_token_ids,
            max_model_len=spec.max_model_len,
        )
        self.runner = ModelRunner(model, kv, graphs, config.overlap_grammar)
        self.scheduler.wait_for_device = self.runner.wait_for_device
        auto = config.async_scheduling == "auto"
        self.async_scheduling = model.device.type == "cuda" if auto else config.async_scheduling == "on"
        self._in_flight: Launched | None = None  # the step launched last, not yet postprocessed
        self._arrivals = itertools.count()
        # Counters for metrics, written only by the thread that steps; see also the scheduler's.
        self.generation_tokens = 0  # tokens sampled, cancelled requests' included
        self.last_batch: tuple[int, int] = (0, 0)  # (tokens, sampled rows) of the last forward pass

    @property
    def steps(self) -> int:
        """Steps that ran the model."""
        return self.scheduler.launched

    @property
    def kv(self) -> KVCache:
        return self.scheduler.kv

    def new_sequence(
        self,
        key: Hashable,
        prompt_ids: Seq[int],
        options: SamplingOptions,
        priority: int = 0,
        cache_salt: str = "",
        follows: Hashable | None = None,
        generated: Seq[int] = (),
    ) -> Sequence:
        """A checked request, ready for `add`; safe to call from any thread. follows: the key of an earlier
        sample of the same prompt, whose prefill this one waits for, to find its pages in the prefix cache.
        generated: the tokens it already generated elsewhere (it resumes after its worker failed), which
        count as output.

        Raises InvalidArgument for a prompt this model cannot run or a constraint that does not compile,
        ResourceExhausted for a prompt over the context or one that the KV pool can never hold.
        """
        spec = self.model.spec
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        tokens = [*prompt_ids, *generated]
        check_prompt_fits(len(tokens), spec.max_model_len)
        if len(generated) >= options.max_tokens:
            raise InvalidArgument(f"{len(generated)} tokens generated already: max_tokens is reached")
        _check_vocabulary("the prompt", tokens, spec.vocab_size)
        _check_vocabulary("sampling.logit_bias", [t for t, _ in options.logit_bias], spec.vocab_size)
        _check_vocabulary("sampling.stop_token_ids", options.stop_token_ids, spec.vocab_size)
        pages = -(-(len(tokens) + 1) // self.kv.page_size)
        if pages >= self.kv.num_pages:
            raise ResourceExhausted(
                f"the prompt needs {pages} KV pages, more than the pool's {self.kv.num_pages - 1}: "
                "shorten it, or give the workers more --kv-memory"
            )
        seq = Sequence(key, tokens, len(prompt_ids), options, priority, next(self._arrivals))
        seq.cache_root = salted_root(cache_salt)
        seq.follows = follows
        if options.structured is not None:
            if self.grammars is None:
                raise Unimplemented("this engine was started without structured outputs (no tokenizer)")
            seq.grammar = self.grammars.state(options.structured)
            if not all(seq.grammar.accept(token) for token in generated):
                raise InvalidArgument("the generated tokens do not follow sampling.structured")
        return seq

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, key: Hashable) -> RequestOutput | None:
        """End a request now, freeing its pages; None if it is not running (it finished already)."""
        seq = self.scheduler.requests.get(key)
        return None if seq is None else self._finish(seq, FinishReason.ABORT)

    def abort_all(self) -> list[RequestOutput]:
        """End every request with ABORT, and take back every page once the device is done with it."""
        outputs = [self._finish(seq, FinishReason.ABORT) for seq in list(self.scheduler.requests.values())]
        self._let_go()
        return outputs

    def fail_all(self, error: StatusError) -> list[RequestOutput]:
        """End every request with error: the step cannot go on (the KV pool is gone, say)."""
        outputs = [
            self._finish(seq, FinishReason.ABORT, error) for seq in list(self.scheduler.requests.values())
        ]
        self._let_go()
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests) or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Schedule, launch the model on the plan, and postprocess the step before, which the device ran
        meanwhile (or this one, with no async scheduling); returns what every request got."""
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if previous is not None and (not self.async_scheduling or previous.step.needs_host):
            outputs += self._complete(previous)
            previous = None
        plan = self.scheduler.schedule()
        outputs += [RequestOutput.of(seq) for seq in plan.finished]
        if plan.items:
            step = self.runner.launch(plan.items, previous.step if previous is not None else None)
            self._in_flight = Launched(self.scheduler.commit(plan.items, step.sampled), step)
            self.last_batch = (step.num_tokens, len(step.sampled))
        if previous is not None:
            outputs += self._complete(previous)
        if not self.async_scheduling and self._in_flight is not None:
            outputs += self._complete(self._in_flight)
            self._in_flight = None
        return outputs

    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request finishes (for tests and benchmarks, with no thread)."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            outputs += self.step()
        return outputs

    def rebind(self, kv: KVCache) -> None:
        """Run on another pool; call with no request unfinished."""
        assert not self.has_unfinished(), "the requests on the old pool must be gone"
        self.scheduler.kv = kv
        self.runner.rebind(kv)

    def kv_slots(self) -> tuple[int, int]:
        """(allocated, used) token slots of the running sequences: fragmentation is 1 - used / allocated."""
        running = self.scheduler.running
        allocated = sum(len(seq.pages) for seq in running) * self.kv.page_size
        return allocated, sum(seq.num_computed for seq in running)

    def _let_go(self) -> None:
        """Drop the step in flight, whose requests are gone, and take back the pages held for launched steps
        once the device is done with them, or failed."""
        self._in_flight = None
        try:
            self.scheduler.settle()
        except RuntimeError:  # a CUDA error sticks: every later wait raises it again
            log.exception("the device failed; its steps' pages go back unwritten")
            self.scheduler.device_finished(self.scheduler.launched)

    def _complete(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens, and do its bookkeeping."""
        samples = launched.step.wait()
        self.generation_tokens += len(samples.token_ids)
        return self.scheduler.postprocess(launched.launch, samples, launched.step.scored)

    def _finish(self, seq: Sequence, reason: FinishReason, error: StatusError | None = None) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        return RequestOutput.of(seq, error=error)


def _check_vocabulary(what: str, token_ids: Seq[int], vocab_size: int) -> None:
    if token_ids and not (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise InvalidArgument(f"{what} has token id {bad}, outside the vocabulary (0..{vocab_size - 1})")
