"""The engine core: one step at a time, on the caller's thread: schedule, run the model, postprocess.

It runs in one of two modes, chosen once at start (`EngineConfig.async_scheduling`):
- one by one (`_step_one_by_one`): schedule, launch, wait for the tokens, postprocess;
- overlapped with the device (`_step_overlapped`): schedule and launch the next step while the device runs
  this one, whose tokens are postprocessed once the next is launched; each step's outputs come from the next
  call to `step`, at about the time the device finishes it.
It checks and admits requests, aborts them, and fails them all when the step cannot go on. It knows no
thread (`loop` runs it in one), no gRPC and no protobuf (the servicer converts its outputs). Tests and
benchmarks drive it directly with `add(new_sequence(key, request))`, `step` and `run_until_done`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable

from memory_daemon.prefix import page_keys, salted_root
from pagedserve.plumbing.errors import FailedPrecondition, ResourceExhausted, StatusError, Unimplemented
from services.common.request import EngineRequest, ModelLimits, check_request
from services.worker.core.cuda_graphs import DecodeGraphs
from services.worker.core.draft_model import DraftModelProposer
from services.worker.core.engine_config import EngineConfig
from services.worker.core.grammar import Grammars
from services.worker.core.model_runner import ModelRunner, StepInFlight
from services.worker.core.scheduler import Plan, Scheduler
from services.worker.core.sequence import FinishReason, RequestOutput, Sequence
from services.worker.core.speculation import NgramProposer, Proposer
from services.worker.kv.base import KVCache
from services.worker.kv.groups import group_key
from services.worker.models import CausalLM

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        config: EngineConfig,
        graphs: DecodeGraphs | None = None,
        grammars: Grammars | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """proposer: with --speculative draft, the draft model's (`draft_model`); ngram's is made here."""
        if (config.speculative == "draft") != (proposer is not None):
            raise ValueError("a draft model's proposer goes with --speculative draft, and only with it")
        if config.speculative == "ngram":
            proposer = NgramProposer(config.num_speculative_tokens)
        self.model = model
        self.config = config
        self.draft = proposer if isinstance(proposer, DraftModelProposer) else None
        self.grammars = grammars  # compiles structured outputs; None: the engine refuses them
        spec = model.spec
        self.scheduler = Scheduler(
            kv,
            max_batched_tokens=config.max_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            prefix_caching=config.prefix_caching,
            eos_token_ids=spec.eos_token_ids,
            max_model_len=spec.max_model_len,
            windows=spec.kv_groups.windows,
            proposer=proposer,
        )
        self.runner = ModelRunner(model, kv, graphs, config.overlap_grammar)
        self.limits = ModelLimits(spec.vocab_size, spec.max_model_len)
        auto = config.async_scheduling == "auto"
        self.async_scheduling = model.device.type == "cuda" if auto else config.async_scheduling == "on"
        self.step = self._step_overlapped if self.async_scheduling else self._step_one_by_one
        self._in_flight: StepInFlight | None = None  # the step launched last, not yet postprocessed
        self._arrivals = itertools.count()
        # Counters for metrics, written only by the thread that steps; see also the scheduler's.
        # Tokens sampled and kept (a draft's rejected ones are not), cancelled requests' included.
        self.generation_tokens = 0
        self.last_batch: tuple[int, int] = (0, 0)  # (tokens, sampled rows) of the last forward pass

    @property
    def steps(self) -> int:
        """Steps that ran the model."""
        return self.scheduler.launched

    @property
    def kv(self) -> KVCache:
        return self.scheduler.kv

    def new_sequence(self, key: Hashable, request: EngineRequest) -> Sequence:
        """A checked request, ready for `add`; safe to call from any thread. A request that follows an
        earlier sample has a key (namespace, request id), and follows that namespace's request.follows. A
        structured output's grammar compiles off the engine's thread: the sequence waits (COMPILING) until it
        is ready, and is refused then if it does not compile.

        Raises InvalidArgument for a prompt this model cannot run, ResourceExhausted for a prompt over the
        context or one that the KV pool can never hold.
        """
        check_request(request, self.limits)
        pages = -(-(len(request.prompt_ids) + len(request.generated) + 1) // self.kv.page_size)
        usable = self.kv.num_pages - 1 - self.kv.pin_budget_pages
        if pages > usable:
            pinnable = self.kv.pin_budget_pages
            beyond = f" less the {pinnable} that pins may hold (the daemon's --pin-share)" if pinnable else ""
            raise ResourceExhausted(
                f"the prompt needs {pages} KV pages, more than the pool's {self.kv.num_pages - 1}{beyond}: "
                "shorten it, or give the workers more --kv-memory"
            )
        grammar = None
        if request.options.structured is not None:
            if self.grammars is None:
                raise Unimplemented("this engine was started without structured outputs (no tokenizer)")
            grammar = self.grammars.state_later(request.options.structured)
        follows = (key[0], request.follows) if request.follows and isinstance(key, tuple) else None
        seq = Sequence(key, request, next(self._arrivals), follows, grammar)
        if self.config.prefix_caching:
            self._warm(seq)
        return seq

    def check_pins(self, request: EngineRequest) -> None:
        """Refuse a request with cache_ttl_seconds whose tenant has no room to pin its prompt's pages:
        ResourceExhausted, naming the budget (the pool's owner decides); any thread may call it."""
        if not request.cache_ttl_seconds:
            return
        check_request(request, self.limits)  # a bad TTL or tenant is the request's fault, told as such
        if not self.config.prefix_caching:
            raise FailedPrecondition(
                "this worker runs without prefix caching, so it cannot pin a request's pages: send the "
                "request without cache_ttl_seconds"
            )
        # The keys of its full pages in every group: those it pins already (a conversation that goes on)
        # cost its tenant nothing.
        tokens = [*request.prompt_ids, *request.generated]
        keys = page_keys(tokens, self.kv.page_size, salted_root(request.cache_salt))
        groups = range(len(self.scheduler.windows))
        self.kv.check_pins(request.tenant, [group_key(key, group) for group in groups for key in keys])

    def _warm(self, seq: Sequence) -> None:
        """Ask the pool to bring the prompt's pages back from a lower tier before the scheduler looks them
        up (KVCache.warm, in the background): the keys each group's lookup will ask for."""
        if not self.kv.lower_tier:
            return
        size = self.kv.page_size
        keys = seq.page_keys((seq.num_tokens - 1) // size, size)
        for group in range(len(self.scheduler.windows)):
            self.kv.warm([group_key(key, group) for key in keys])

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

    def has_work(self) -> bool:
        """Whether a step would do anything now (a request whose grammar is compiling waits without it)."""
        return self.scheduler.has_work() or self._in_flight is not None

    def _step_one_by_one(self) -> list[RequestOutput]:
        """Schedule, launch, wait for the tokens, postprocess; returns what every request got."""
        plan = self._schedule()
        if not plan.items:
            return plan.ended
        step = self._launch(plan, previous=None)
        return plan.ended + self._complete(step)

    def _step_overlapped(self) -> list[RequestOutput]:
        """Schedule and launch this step while the device runs the one before, then postprocess that one;
        returns what every request got. A step whose tokens the next one's schedule reads (`needs_host`, or
        a proposer's draft) is postprocessed first."""
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if previous is not None and (previous.needs_host or self.scheduler.would_draft(previous.sampled)):
            outputs += self._complete(previous)
            previous = None
        plan = self._schedule()
        outputs += plan.ended
        if plan.items:
            self._in_flight = self._launch(plan, previous)
        if previous is not None:
            outputs += self._complete(previous)
        return outputs

    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request finishes (for tests and benchmarks, with no thread)."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            outputs += self.step()
        return outputs

    def rebind(self, kv: KVCache, draft_kv: KVCache | None = None) -> None:
        """Run on another pool (and the draft model on draft_kv); call with no request unfinished."""
        assert not self.has_unfinished(), "the requests on the old pool must be gone"
        self.scheduler.kv = kv
        self.runner.rebind(kv)
        if self.draft is not None:
            assert draft_kv is not None, "the draft model needs a pool too"
            self.draft.rebind(draft_kv)

    def kv_slots(self) -> tuple[int, int]:
        """(allocated, used) token slots of the running sequences: fragmentation is 1 - used / allocated."""
        running = self.scheduler.running
        size = self.kv.page_size
        allocated = sum(len(seq.held_pages) for seq in running) * size
        used = sum(seq.num_computed - dropped * size for seq in running for dropped in seq.dropped)
        return allocated, used

    def _schedule(self) -> Plan:
        plan = self.scheduler.schedule()
        if plan.awaits_device:  # pages a step in flight may still write: wait for it, rather than preempt
            self._settle()
            again = self.scheduler.schedule()
            plan = Plan(again.items, plan.ended + again.ended)
        return plan

    def _launch(self, plan: Plan, previous: StepInFlight | None) -> StepInFlight:
        step = self.runner.launch(plan.items, self.scheduler.launched + 1, previous)
        self.scheduler.commit(step)
        self.last_batch = (step.num_tokens, len(step.sampled))
        return step

    def _settle(self) -> None:
        """Wait for every launched step, and take back the pages held for them."""
        self.runner.wait_for_device()
        self.scheduler.device_finished(self.scheduler.launched)

    def _let_go(self) -> None:
        """Drop the step in flight, whose requests are gone, and take back the pages held for launched steps
        once the device is done with them, or failed."""
        self._in_flight = None
        try:
            self._settle()
        except RuntimeError:  # a CUDA error sticks: every later wait raises it again
            log.exception("the device failed; its steps' pages go back unwritten")
            self.scheduler.device_finished(self.scheduler.launched)

    def _complete(self, step: StepInFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens, and do its bookkeeping."""
        samples = step.wait()
        accepted = self.scheduler.accepted_tokens
        outputs = self.scheduler.postprocess(step, samples)
        self.generation_tokens += len(step.sampled) + self.scheduler.accepted_tokens - accepted
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason, error: StatusError | None = None) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        return RequestOutput.of(seq, error=error)
