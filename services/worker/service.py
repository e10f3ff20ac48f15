"""The Worker gRPC servicer: one multiplexed Connect stream per frontend connection, at the engine's edge.

It talks to the engine through its facade (`core.loop.Engine`) alone. The engine thread hands each step's
outputs to `_on_outputs`, which converts them to messages, splits them
by stream and passes one StepOutputs per stream to the event loop. A request is keyed in the engine by
(stream, request id); when a stream ends, a crashed frontend included, every request it still had running
is aborted, so its pages come back within one step. This module and `wire` are the only places where the
worker's plain values meet protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2

from pagedserve.plumbing.errors import InvalidArgument, StatusError, Unavailable
from pagedserve.plumbing.rpc import HealthServicer
from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.wire import HEARTBEAT_S, error_fields, request_from_pb
from services.worker.core.loop import Engine, RequestOutput, TokenLogprob

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
_Reason = generation_pb2.GenerateResponse.FinishReason
DRAINING = "the worker is shutting down"
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        engine: Engine,
        info: worker_pb2.WorkerInfo,
        loop: asyncio.AbstractEventLoop,
        stall_timeout_s: float = 5.0,
    ) -> None:
        self._engine = engine
        self._info = info
        self._loop = loop
        self._stall_timeout_s = stall_timeout_s
        self.health: HealthServicer | None = None  # the server's, once it runs
        self._draining = False
        self._serving = True
        self._streams: dict[int, asyncio.Queue[worker_pb2.StepOutputs | None]] = {}
        self._stream_ids = itertools.count(1)
        engine.on_outputs = self._on_outputs

    async def Connect(
        self, request_iterator: AsyncIterator[worker_pb2.WorkerRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepOutputs]:
        stream = next(self._stream_ids)
        queue: asyncio.Queue[worker_pb2.StepOutputs | None] = asyncio.Queue()
        self._streams[stream] = queue
        live: set[str] = set()
        reader = asyncio.create_task(self._read(stream, request_iterator, queue, live))
        log.info("frontend stream %d opened by %s", stream, context.peer())
        yield worker_pb2.StepOutputs(load=self._load())  # whether it accepts requests, before it is sent any
        reading = True
        try:
            while (reading and not self._draining) or live:
                message = await queue.get()
                if message is None:  # the frontend closed its side; finish what it started
                    reader.result()
                    reading = False
                    continue
                for output in message.outputs:
                    if output.finish_reason:
                        live.discard(output.request_id)
                yield message
            if self._draining:  # else the server's stop waited out its grace on the stream, then cancelled it
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        finally:
            reader.cancel()
            del self._streams[stream]
            if live:
                self._engine.abort((stream, request_id) for request_id in live)
            log.info("frontend stream %d closed; aborted %d running requests", stream, len(live))

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.Load:
        return self._load()

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self._info

    def unavailable(self) -> str:
        """Why this worker refuses new requests (it is shutting down, its KV pool is out of reach, its engine
        is stuck); empty when it accepts them."""
        if self._draining:
            return DRAINING
        return self._engine.suspended or self._engine.stalled(self._stall_timeout_s) or ""

    async def drain(self) -> None:
        """At shutdown: refuse new requests, telling every frontend stream at once, and end each stream
        once its running requests have finished."""
        self._draining = True
        await self.refresh()  # wakes each stream, which then ends if nothing runs on it

    async def refresh(self) -> None:
        """Tell health and every frontend stream whether this worker accepts requests, at once."""
        why = self.unavailable()
        if self._serving == bool(why) and self.health is not None:
            self._serving = not why
            log.warning("%s", why or "accepting requests again")
            status = (
                health_pb2.HealthCheckResponse.NOT_SERVING if why else health_pb2.HealthCheckResponse.SERVING
            )
            await self.health.set(SERVICE_NAME, status)
        message = worker_pb2.StepOutputs(load=self._load())
        for queue in self._streams.values():
            queue.put_nowait(message)

    async def beat(self) -> None:
        """The heartbeat: refresh every HEARTBEAT_S, so that a frontend tells a frozen worker by silence."""
        while True:
            await self.refresh()
            await asyncio.sleep(HEARTBEAT_S)

    async def _read(
        self,
        stream: int,
        requests: AsyncIterator[worker_pb2.WorkerRequest],
        queue: asyncio.Queue[worker_pb2.StepOutputs | None],
        live: set[str],
    ) -> None:
        try:
            async for request in requests:
                for submit in request.submit:
                    if error := await self._submit(stream, submit, live):
                        self._refuse(queue, submit.request_id, error)
                if request.abort:
                    self._engine.abort((stream, rid) for rid in request.abort if rid in live)
        finally:
            queue.put_nowait(None)

    def _refuse(
        self, queue: asyncio.Queue[worker_pb2.StepOutputs | None], request_id: str, error: dict
    ) -> None:
        refused = worker_pb2.RequestOutput(request_id=request_id, finish_reason=_Reason.ABORT, **error)
        # Every message carries the load, which the frontend takes as it is.
        queue.put_nowait(worker_pb2.StepOutputs(outputs=[refused], load=self._load()))

    async def _submit(self, stream: int, submit: worker_pb2.Submit, live: set[str]) -> dict[str, Any]:
        """Queue one request; return the error fields of its refusal, or nothing when it was accepted. A
        request that pins its pages is first checked against its tenant's pin budget, by the daemon.

        A submit that cannot be answered by its own id breaks the protocol and ends the stream.
        """
        if not submit.request_id:
            raise InvalidArgument("a submit has an empty request_id")
        if submit.request_id in live:
            raise InvalidArgument(
                f"request id {submit.request_id!r} is already running on this stream; ids must be unique"
            )
        try:
            if self._draining:
                raise Unavailable(DRAINING)
            request = request_from_pb(submit)
            if request.cache_ttl_seconds:
                await asyncio.to_thread(self._engine.check_pins, request)
            self._engine.submit((stream, submit.request_id), request)
        except StatusError as refusal:
            return error_fields(refusal)
        live.add(submit.request_id)
        return {}

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after each step."""
        by_stream: defaultdict[int, list[worker_pb2.RequestOutput]] = defaultdict(list)
        for output in outputs:
            stream, request_id = cast(tuple[int, str], output.key)
            by_stream[stream].append(output_pb(request_id, output))
        load = self._load()
        for stream, pbs in by_stream.items():
            queue = self._streams.get(stream)
            if queue is not None:
                message = worker_pb2.StepOutputs(outputs=pbs, load=load)
                with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
                    self._loop.call_soon_threadsafe(queue.put_nowait, message)

    def _load(self) -> worker_pb2.Load:
        running, waiting = self._engine.load()
        kv = self._engine.kv
        usage = kv.usage()
        return worker_pb2.Load(
            running=running,
            waiting=waiting,
            kv_pages_in_use=usage.in_use_pages + usage.referenced_pages,
            kv_pages_total=kv.num_pages - 1,
            unavailable=self.unavailable(),
        )


def output_pb(request_id: str, output: RequestOutput) -> worker_pb2.RequestOutput:
    reason = output.finish_reason.name if output.finish_reason else None
    return worker_pb2.RequestOutput(
        request_id=request_id,
        token_ids=output.token_ids,
        logprobs=[logprobs_pb(lp) for lp in output.logprobs],
        finish_reason=reason,
        prompt_tokens=output.prompt_tokens,
        cached_prompt_tokens=output.cached_prompt_tokens,
        prompt_logprobs=[logprobs_pb(lp) for lp in output.prompt_logprobs],
        **(error_fields(output.error) if output.error else {}),
    )


def logprobs_pb(logprob: TokenLogprob) -> generation_pb2.TokenLogprobs:
    top = [generation_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top]
    return generation_pb2.TokenLogprobs(token_id=logprob.token_id, logprob=logprob.logprob, top=top)
