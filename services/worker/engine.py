"""The engine loop: schedule, build the batch, run the model, sample, check stops, emit. In its own thread.

Submissions and aborts arrive from other threads through an inbox; the loop drains it at the top of every
step, so an abort frees the request's pages before the next step runs. Each step's new tokens, for every
request at once, go to one callback.

For metrics, the engine keeps plain counters and, after every step of its thread, a tuple of numbers that
would otherwise need a walk over the running sequences, so another thread reads them without a race.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2
from services.common.errors import ResourceExhausted
from services.common.sampling import SamplingOptions
from services.worker.batch import build_batch
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.kv import KVCache
from services.worker.models import CausalLM
from services.worker.sampler import TokenLogprob, sample
from services.worker.scheduler import Scheduler
from services.worker.sequence import FinishReason, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batched_tokens: int = 1024  # tokens per step, prefill chunks and decodes together
    max_num_seqs: int = 64  # sequences running at once
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be positive")


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    key: Hashable
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token, when the request asked
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: str | None = None  # set when the engine refused or failed the request
    error_code: grpc.StatusCode = grpc.StatusCode.INTERNAL  # for error: UNAVAILABLE when the daemon is gone

    def to_pb(self, request_id: str) -> worker_pb2.RequestOutput:
        """As the Worker contract carries it; an engine failure is INTERNAL."""
        reason = self.finish_reason.name if self.finish_reason else "FINISH_REASON_UNSPECIFIED"
        return worker_pb2.RequestOutput(
            request_id=request_id,
            token_ids=self.token_ids,
            logprobs=[lp.to_pb() for lp in self.logprobs],
            finish_reason=generation_pb2.GenerateResponse.FinishReason.Value(reason),
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            error=self.error or "",
            error_code=self.error_code.value[0] if self.error else 0,
        )


class Engine:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        config: EngineConfig,
        on_outputs: Callable[[list[RequestOutput]], None] | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.graphs = graphs
        self.kv = kv
        self.config = config
        self.scheduler = Scheduler(
            kv,
            max_batched_tokens=config.max_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            prefix_caching=config.prefix_caching,
        )
        self.on_outputs = on_outputs
        self.steps = 0
        self.last_batch: tuple[int, int] = (0, 0)  # (tokens, sampled rows) of the last forward pass
        # Counters for metrics, written only by the engine. A request's prompt is counted the first time it
        # is scheduled, with what the prefix cache held for it then; a recompute after preemption is not.
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.kv_slots: tuple[int, int] = (0, 0)  # (allocated, used) token slots of running sequences
        self.on_step: Callable[[float, int], None] | None = None  # (seconds, tokens) of each forward step
        self._scheduled: set[Hashable] = set()  # live requests whose prompt has been counted
        self._eos = frozenset(model.spec.eos_token_ids)
        self._live: dict[Hashable, Sequence] = {}  # touched only by the engine thread
        self._wake = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[Hashable] = []
        self._commands: list[tuple[Callable[[], list[RequestOutput]], Future[None]]] = []
        self.suspended: str | None = None  # why new requests are refused: the KV pool is out of reach
        self._arrivals = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # Called from any thread ------------------------------------------------------------------------

    def submit(
        self, key: Hashable, prompt_ids: Seq[int], options: SamplingOptions, priority: int = 0
    ) -> None:
        """Queue a request; raises ValueError for a prompt this model cannot run, ResourceExhausted for one
        that the KV pool can never hold, and ConnectionError while the pool is out of reach."""
        if self.suspended is not None:
            raise ConnectionError(self.suspended)
        spec = self.model.spec
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= spec.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens, but the model's context is {spec.max_model_len}, "
                "and at least one must be left to generate"
            )
        bad = next((t for t in prompt_ids if not 0 <= t < spec.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{spec.vocab_size - 1})")
        pages = -(-(len(prompt_ids) + 1) // self.kv.page_size)
        if pages >= self.kv.num_pages:
            raise ResourceExhausted(
                f"the prompt needs {pages} KV pages, more than the pool's {self.kv.num_pages - 1}: "
                "shorten it, or give the workers more --kv-memory"
            )
        seq = Sequence(key, list(prompt_ids), len(prompt_ids), options, priority, next(self._arrivals))
        with self._wake:
            self._inbox.append(seq)
            self._wake.notify()

    def abort(self, keys: Iterable[Hashable]) -> None:
        with self._wake:
            self._aborts.extend(keys)
            self._wake.notify()

    def suspend(self, reason: str) -> Future[None]:
        """Fail every live request with UNAVAILABLE and refuse new ones, until resume: the pool is gone."""

        def command() -> list[RequestOutput]:
            self.suspended = reason
            return self._fail_all(reason, grpc.StatusCode.UNAVAILABLE)

        return self._command(command)

    def resume(self, kv: KVCache) -> Future[None]:
        """Run on a new KV cache (the daemon came back): call after suspend."""

        def command() -> list[RequestOutput]:
            assert not self._live, "suspend first: the requests on the old pool must be gone"
            self.kv = self.scheduler.kv = kv
            if self.graphs is not None:
                self.graphs.kv = kv.kv
                self.graphs.capture()  # the graphs baked in the old pool's address
            self.suspended = None
            return []

        return self._command(command)

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._wake:
            queued = len(self._inbox)
        return len(self.scheduler.running), self.scheduler.num_waiting + queued

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    # The engine thread ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns what it produced."""
        outputs = self._drain_inbox()
        plan = self.scheduler.schedule()
        for seq in plan.finished:
            outputs.append(self._finished(seq, [], []))
        if not plan.items:
            return outputs
        for item in plan.items:
            seq = item.seq
            if seq.key not in self._scheduled:
                self._scheduled.add(seq.key)
                self.prompt_tokens += seq.prompt_len
                self.cached_prompt_tokens += seq.cached_prompt_tokens
        batch = build_batch(plan.items, self.kv.page_size, self.model.device)
        logits = self.graphs.run(batch) if self.graphs is not None else None
        if logits is None:  # a prefill, a batch larger than any graph, or no graphs
            logits = self.model.forward(
                batch.input_ids, batch.positions, batch.meta, self.kv.kv, batch.logits_indices
            )
        samples = sample(logits, [item.seq for item in batch.sampling])
        self.steps += 1
        self.last_batch = (batch.num_tokens, len(batch.sampling))
        self.generation_tokens += len(batch.sampling)
        for item in batch.items:
            item.seq.num_computed += item.count
            self.scheduler.publish_full_pages(item.seq)
        for item, token, logprob in zip(batch.sampling, samples.token_ids, samples.logprobs, strict=True):
            seq = item.seq
            seq.tokens.append(token)
            reason = self._stop_reason(seq, token)
            logprobs = [logprob] if logprob is not None else []
            if reason is None:
                outputs.append(
                    RequestOutput(seq.key, [token], logprobs, None, seq.prompt_len, seq.cached_prompt_tokens)
                )
            else:
                self.scheduler.finish(seq, reason)
                outputs.append(self._finished(seq, [token], logprobs))
        return outputs

    def has_work(self) -> bool:
        """Whether a request is live or queued (call from the engine's own thread)."""
        return bool(self._live or self._inbox or self._aborts or self._commands)

    def run_until_done(self) -> list[RequestOutput]:
        """Step until every submitted request finishes (for tests and benchmarks, without the thread)."""
        outputs: list[RequestOutput] = []
        while self.has_work():
            outputs += self.step()
        return outputs

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopping or self.has_work())
                if self._stopping:
                    break
            steps, started = self.steps, time.perf_counter()
            try:
                outputs = self.step()
            except ConnectionError as exc:  # the memory daemon went away mid-step: the worker re-attaches
                log.error("lost the KV pool: %s", exc)
                self.suspended = f"the KV memory daemon is out of reach ({exc}); retry"
                outputs = self._fail_all(self.suspended, grpc.StatusCode.UNAVAILABLE)
            except Exception:
                log.exception("engine step failed; failing every live request")
                outputs = self._fail_all("the engine failed on this request's step; see the worker log")
            self._observe_step(time.perf_counter() - started, ran=self.steps != steps)
            if outputs and self.on_outputs is not None:
                self.on_outputs(outputs)
        outputs = [self._finish(seq, FinishReason.ABORT) for seq in list(self._live.values())]
        if outputs and self.on_outputs is not None:
            self.on_outputs(outputs)

    def _observe_step(self, seconds: float, ran: bool) -> None:
        """Refresh the numbers other threads read; O(running sequences), a few microseconds."""
        running = self.scheduler.running
        allocated = sum(len(seq.pages) for seq in running) * self.kv.page_size
        self.kv_slots = (allocated, sum(seq.num_computed for seq in running))
        if ran and self.on_step is not None:
            self.on_step(seconds, self.last_batch[0])

    def _command(self, command: Callable[[], list[RequestOutput]]) -> Future[None]:
        done: Future[None] = Future()
        with self._wake:
            self._commands.append((command, done))
            self._wake.notify()
        return done

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._wake:
            commands, self._commands = self._commands, []
            arrived, self._inbox = self._inbox, []
            aborted, self._aborts = self._aborts, []
        outputs = []
        for command, done in commands:
            outputs += command()
            done.set_result(None)
        for seq in arrived:
            if seq.key in self._live:
                outputs.append(
                    RequestOutput(seq.key, [], [], FinishReason.ABORT, error="request id is already running")
                )
                continue
            self._live[seq.key] = seq
            self.scheduler.add(seq)
        for key in aborted:
            seq = self._live.get(key)
            if seq is not None:
                outputs.append(self._finish(seq, FinishReason.ABORT))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        options = seq.options
        if token in options.stop_token_ids or (not options.ignore_eos and token in self._eos):
            return FinishReason.STOP
        if (
            seq.num_tokens - seq.prompt_len >= options.max_tokens
            or seq.num_tokens >= self.model.spec.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        error: str | None = None,
        code: grpc.StatusCode = grpc.StatusCode.INTERNAL,
    ) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        return self._finished(seq, [], [], error, code)

    def _finished(
        self,
        seq: Sequence,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        error: str | None = None,
        code: grpc.StatusCode = grpc.StatusCode.INTERNAL,
    ) -> RequestOutput:
        del self._live[seq.key]
        self._scheduled.discard(seq.key)
        return RequestOutput(
            seq.key,
            token_ids,
            logprobs,
            seq.finish_reason,
            prompt_tokens=seq.prompt_len,
            cached_prompt_tokens=seq.cached_prompt_tokens,
            error=error,
            error_code=code,
        )

    def _fail_all(
        self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    ) -> list[RequestOutput]:
        return [self._finish(seq, FinishReason.ABORT, message, code) for seq in list(self._live.values())]
