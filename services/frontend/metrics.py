"""The frontend's Prometheus metrics: latency as clients see it, final statuses, tokens and admission.

Everything here runs on the frontend's event loop except the scrape, which only reads prometheus_client's
own locked values and two ints of the Admission. One `RequestTracker` follows each Generate or Complete
call from the moment it reaches the servicer:
- time to first token: until the first message that carries a token;
- inter-token latency: one observation per later token, the gap since the previous message divided over
  the tokens of the message (one token per engine step, so a request of n tokens gives n - 1);
- queue time: the wait for an admission slot, for every request that got one;
- end-to-end latency, and the prompt and generation tokens of its usage: for requests that end OK;
- `pagedserve_requests_total{code}`: every call, with its final gRPC status, refusals before admission
  included. A cancelled handler sees CancelledError (or GeneratorExit when it was suspended at a yield);
  the call's deadline tells DEADLINE_EXCEEDED from CANCELLED.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

import grpc
from prometheus_client import Counter, Gauge, Histogram

from pagedserve.plumbing.status import status_of
from pagedserve.v1 import generation_pb2
from services.frontend.admission import Admission

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
# Shown at zero from the start, so a rate over them exists before the first such request.
DEADLINE_SLACK_S = 0.5
_COMMON_CODES = "OK INVALID_ARGUMENT RESOURCE_EXHAUSTED UNAVAILABLE CANCELLED DEADLINE_EXCEEDED INTERNAL"

TIME_TO_FIRST_TOKEN = Histogram(
    "pagedserve_time_to_first_token_seconds",
    "from the request reaching the servicer to its first token",
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "pagedserve_inter_token_latency_seconds",
    "per output token after the first: the gap since the previous message over its tokens",
    buckets=_ITL_BUCKETS,
)
REQUEST_QUEUE = Histogram(
    "pagedserve_request_queue_seconds", "wait for an admission slot", buckets=_LATENCY_BUCKETS
)
E2E_REQUEST_LATENCY = Histogram(
    "pagedserve_e2e_request_latency_seconds",
    "from the request reaching the servicer to its last message, for requests that end OK",
    buckets=_LATENCY_BUCKETS,
)
REQUESTS = Counter("pagedserve_requests", "Generate and Complete calls by final gRPC status", ["code"])
PROMPT_TOKENS = Counter("pagedserve_prompt_tokens", "prompt tokens of requests that ended OK")
GENERATION_TOKENS = Counter("pagedserve_generation_tokens", "completion tokens of requests that ended OK")
SLOW_READERS = Counter(
    "pagedserve_slow_readers", "streams cancelled because the client did not read them for --drain-timeout"
)
REQUESTS_RUNNING = Gauge("pagedserve_requests_running", "requests holding an admission slot")
REQUESTS_WAITING = Gauge("pagedserve_requests_waiting", "requests queued for an admission slot")
for _code in _COMMON_CODES.split():
    REQUESTS.labels(_code)


def track_admission(admission: Admission) -> None:
    """Report the admission's counts at each scrape (reading two ints is safe from the scrape thread)."""
    REQUESTS_RUNNING.set_function(lambda: admission.running)
    REQUESTS_WAITING.set_function(lambda: admission.waiting)


class RequestTracker:
    """One call's clock and outcome: a context manager around the whole handler."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._start = time.perf_counter()
        self._queued = self._start
        self._last: float | None = None  # when the last message with tokens went out
        self._prompt_tokens = 0
        self._completion_tokens = 0  # of every sample

    def __enter__(self) -> RequestTracker:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        code = self._code(exc)
        REQUESTS.labels(code.name).inc()
        if code is grpc.StatusCode.OK:
            E2E_REQUEST_LATENCY.observe(time.perf_counter() - self._start)
            PROMPT_TOKENS.inc(self._prompt_tokens)
            GENERATION_TOKENS.inc(self._completion_tokens)

    def queued(self) -> None:
        self._queued = time.perf_counter()

    def admitted(self) -> None:
        REQUEST_QUEUE.observe(time.perf_counter() - self._queued)

    def responded(self, response: generation_pb2.GenerateResponse) -> None:
        """Note a response: the call's latencies are its first sample's, its tokens every sample's."""
        tokens = len(response.token_ids)
        if tokens and response.index == 0:
            now = time.perf_counter()
            if self._last is None:
                TIME_TO_FIRST_TOKEN.observe(now - self._start)
            else:
                gap = (now - self._last) / tokens
                for _ in range(tokens):
                    INTER_TOKEN_LATENCY.observe(gap)
            self._last = now
        if response.HasField("usage"):
            self._prompt_tokens = response.usage.prompt_tokens
            self._completion_tokens += response.usage.completion_tokens

    def _code(self, exc: BaseException | None) -> grpc.StatusCode:
        if exc is None:
            return grpc.StatusCode.OK
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            remaining = self._context.time_remaining()
            # Near its deadline, a cancelled call is taken to have run out of time: the client's clock runs
            # out first and resets the stream, while ours started when its headers arrived, which on a busy
            # machine can be a good part of a second later.
            expired = remaining is not None and remaining < DEADLINE_SLACK_S
            return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
        return status_of(exc)[0]
