"""The engine's facade at the thread boundary: the engine core stepped on a thread of its own, fed through an
inbox, and the one interface the servicer, metrics and server use.

`submit` checks a request and queues it, `abort` ends requests, `load` and `stats` say what the engine holds
(a frozen snapshot the engine thread replaces after every step, so no other thread reads the core), and
`suspend`/`resume` take the engine off a lost KV pool and onto a new one. The loop drains the inbox at the
top of every step, so an abort frees the request's pages before the next step runs. Each step's outputs, for
every request at once, go to one callback. If a step fails because the KV pool went away, every request fails
UNAVAILABLE and new ones are refused until `resume`; if it fails for any other reason, that is a bug: it is
logged with its traceback and every live request fails INTERNAL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from pagedserve.plumbing.errors import Internal, Unavailable
from services.common.request import EngineRequest
from services.worker.core.engine import EngineCore
from services.worker.core.grammar import Grammars
from services.worker.core.sequence import FinishReason, RequestOutput, Sequence, TokenLogprob
from services.worker.kv.base import KVCache, PoolLost
from services.worker.models.spec import ModelSpec

__all__ = ["Engine", "EngineStats", "FinishReason", "RequestOutput", "TokenLogprob"]

log = logging.getLogger(__name__)

Command = Callable[[], list[RequestOutput]]


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds and has done, as of its last step. Token counts: a request's prompt tokens, and
    those found in the prefix cache, count when it is first admitted (a recompute after preemption does not
    count again); every sampled token counts, cancelled requests' included."""

    running: int = 0
    waiting: int = 0  # queued in the engine, or waiting for their grammars
    kv_slots_allocated: int = 0  # token slots in the pages of running sequences
    kv_slots_used: int = 0  # of those, slots holding KV: fragmentation is 1 - used / allocated
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0  # steps that ran the model
    # Speculative decoding: drafts checked, their tokens, and those kept.
    drafts_checked: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class Engine:
    def __init__(
        self, core: EngineCore, on_outputs: Callable[[list[RequestOutput]], None] | None = None
    ) -> None:
        self._core = core
        self.on_outputs = on_outputs
        self.on_step: Callable[[float, int], None] | None = None  # (seconds, tokens) of each model step
        self.suspended: str | None = None  # why new requests are refused: the KV pool is out of reach
        # Called from the engine's thread when a step finds the pool out of reach (a daemon call failed):
        # the worker then leases anew, as when the daemon ends the lease itself.
        self.on_pool_lost: Callable[[], None] | None = None
        self._stats = EngineStats()
        self._wake = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[Hashable] = []
        self._commands: list[tuple[Command, Future[None]]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._running: Future[None] | None = None  # the loop, on an executor's thread
        self._step_began: float | None = None  # while a step runs, when it began (time.monotonic)
        self._step_seconds: deque[float] = deque(maxlen=100)  # the last steps' durations

    # Called from any thread ------------------------------------------------------------------------

    @property
    def spec(self) -> ModelSpec:
        return self._core.model.spec

    @property
    def kv(self) -> KVCache:
        """The pool the engine runs on (its usage takes its own lock)."""
        return self._core.kv

    @property
    def grammars(self) -> Grammars | None:
        """The structured outputs' compiler (thread-safe); None where the engine refuses them."""
        return self._core.grammars

    @property
    def draft_kv(self) -> KVCache | None:
        """The draft model's pool, with --speculative draft."""
        return self._core.draft.kv if self._core.draft is not None else None

    def submit(self, key: Hashable, request: EngineRequest) -> None:
        """Check a request and queue it under key; its outputs carry key. Raises StatusError for a request the
        engine refuses, and Unavailable while the pool is out of reach."""
        if self.suspended is not None:
            raise Unavailable(self.suspended)
        seq = self._core.new_sequence(key, request)
        if seq.compiling is not None:
            seq.compiling.add_done_callback(lambda _: self._poke())
        with self._wake:
            self._inbox.append(seq)
            self._wake.notify()

    def check_pins(self, request: EngineRequest) -> None:
        """Refuse a request whose tenant has no room to pin its pages (EngineCore.check_pins)."""
        if self.suspended is not None:
            raise Unavailable(self.suspended)
        self._core.check_pins(request)

    def abort(self, keys: Iterable[Hashable]) -> None:
        with self._wake:
            self._aborts.extend(keys)
            self._wake.notify()

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests, those submitted since the last step among the waiting."""
        with self._wake:
            queued = len(self._inbox)
        stats = self._stats
        return stats.running, stats.waiting + queued

    def stats(self) -> EngineStats:
        return self._stats

    def suspend(self, reason: str) -> Future[None]:
        """Fail every live request with UNAVAILABLE and refuse new ones, until resume: the pool is gone."""

        def command() -> list[RequestOutput]:
            self.suspended = reason
            return self._core.fail_all(Unavailable(reason))

        return self._command(command)

    def resume(self, kv: KVCache, draft_kv: KVCache | None = None) -> Future[None]:
        """Run on a new KV cache, and the draft model on draft_kv (the daemon came back): call after
        suspend."""

        def command() -> list[RequestOutput]:
            self._core.rebind(kv, draft_kv)
            self.suspended = None
            return []

        return self._command(command)

    def stalled(self, floor_s: float) -> str | None:
        """Why the engine counts as stuck, or None: a step has run for longer than floor_s and than three
        times the slowest of the last hundred steps (so that a slow machine's long steps do not count)."""
        began = self._step_began
        if began is None:
            return None
        running = time.monotonic() - began
        if running <= max(floor_s, 3 * max(self._step_seconds, default=0.0)):
            return None
        return f"the engine has been in one step for {running:.0f}s"

    def start(self, executor: Executor | None = None) -> None:
        """Run the engine's loop on a thread of its own, or on executor's (the worker's compute thread, which
        loaded the model: services/worker/server.py says why)."""
        if executor is not None:
            self._running = executor.submit(self._run)
            return
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; requests still live end with ABORT."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        if self._running is not None:
            self._running.result()

    # The engine thread ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Drain the inbox, then run one engine step; a failed step fails the live requests."""
        outputs: list[RequestOutput] = []
        try:
            outputs += self._drain_inbox()
            outputs += self._core.step()
        except PoolLost as exc:  # the memory daemon went away mid-step: the worker re-attaches
            log.error("lost the KV pool: %s", exc)
            self.suspended = f"the KV memory daemon is out of reach ({exc}); retry"
            outputs += self._core.fail_all(Unavailable(self.suspended))
            if self.on_pool_lost is not None:
                self.on_pool_lost()
        except Exception:
            log.exception("engine step failed; failing every live request")
            failure = Internal("the engine failed on this request's step; see the worker log")
            outputs += self._core.fail_all(failure)
        self._stats = self._snapshot()
        return outputs

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopping or self._has_work())
                if self._stopping:
                    break
            steps, started = self._core.steps, time.perf_counter()
            self._step_began = time.monotonic()
            outputs = self.step()
            self._step_began = None
            seconds = time.perf_counter() - started
            self._step_seconds.append(seconds)
            if self.on_step is not None and self._core.steps != steps:
                self.on_step(seconds, self._core.last_batch[0])
            self._emit(outputs)
        self._emit(self._core.abort_all())

    def _snapshot(self) -> EngineStats:
        core, scheduler = self._core, self._core.scheduler
        allocated, used = core.kv_slots()
        return EngineStats(
            running=len(scheduler.running),
            waiting=scheduler.num_waiting,
            kv_slots_allocated=allocated,
            kv_slots_used=used,
            preemptions=scheduler.preemptions,
            prompt_tokens=scheduler.prompt_tokens,
            cached_prompt_tokens=scheduler.cached_prompt_tokens,
            generation_tokens=core.generation_tokens,
            steps=core.steps,
            drafts_checked=scheduler.drafts_checked,
            draft_tokens=scheduler.draft_tokens,
            accepted_tokens=scheduler.accepted_tokens,
        )

    def _has_work(self) -> bool:
        return bool(self._core.has_work() or self._inbox or self._aborts or self._commands)

    def _poke(self) -> None:
        """Wake the loop: a grammar is ready."""
        with self._wake:
            self._wake.notify()

    def _emit(self, outputs: list[RequestOutput]) -> None:
        if outputs and self.on_outputs is not None:
            self.on_outputs(outputs)

    def _command(self, command: Command) -> Future[None]:
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
        outputs: list[RequestOutput] = []
        for command, done in commands:
            outputs += command()
            done.set_result(None)
        for seq in arrived:
            self._core.add(seq)
        for key in aborted:
            output = self._core.abort(key)
            if output is not None:
                outputs.append(output)
        return outputs
