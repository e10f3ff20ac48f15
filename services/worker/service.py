"""The Worker gRPC servicer: one multiplexed Connect stream per frontend connection.

The engine thread hands each step's outputs to `_on_outputs`, which splits them by stream and passes one
StepOutputs per stream to the event loop. A request is keyed in the engine by (stream, request id); when
a stream ends, a crashed frontend included, every request it still had running is aborted, so its pages
come back within one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

import grpc

from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.errors import ResourceExhausted, status_for
from services.common.sampling import SamplingOptions
from services.worker.engine import Engine, RequestOutput

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
_ABORT = generation_pb2.GenerateResponse.ABORT


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, info: worker_pb2.WorkerInfo, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._info = info
        self._loop = loop
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
            while reading or live:
                message = await queue.get()
                if message is None:  # the frontend closed its side; finish what it started
                    reader.result()
                    reading = False
                    continue
                for output in message.outputs:
                    if output.finish_reason:
                        live.discard(output.request_id)
                yield message
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

    async def _read(
        self,
        stream: int,
        requests: AsyncIterator[worker_pb2.WorkerRequest],
        queue: asyncio.Queue[worker_pb2.StepOutputs | None],
        live: set[str],
    ) -> None:
        try:
            await self._read_requests(stream, requests, queue, live)
        finally:
            queue.put_nowait(None)

    async def _read_requests(
        self,
        stream: int,
        requests: AsyncIterator[worker_pb2.WorkerRequest],
        queue: asyncio.Queue[worker_pb2.StepOutputs | None],
        live: set[str],
    ) -> None:
        async for request in requests:
            refused = []
            for submit in request.submit:
                refusal = self._submit(stream, submit, live)
                if refusal is not None:
                    error, code = refusal
                    refused.append(
                        worker_pb2.RequestOutput(
                            request_id=submit.request_id,
                            finish_reason=_ABORT,
                            error=error,
                            error_code=code.value[0],
                        )
                    )
            if refused:
                queue.put_nowait(worker_pb2.StepOutputs(outputs=refused))
            if request.abort:
                self._engine.abort((stream, request_id) for request_id in request.abort if request_id in live)

    def _submit(
        self, stream: int, submit: worker_pb2.Submit, live: set[str]
    ) -> tuple[str, grpc.StatusCode] | None:
        """Queue one request; return why it was refused and the status that says so, or None.

        A submit that cannot be answered by its own id breaks the protocol and ends the stream.
        """
        if not submit.request_id:
            raise ValueError("a submit has an empty request_id")
        if submit.request_id in live:
            raise ValueError(
                f"request id {submit.request_id!r} is already running on this stream; ids must be unique"
            )
        try:
            options = SamplingOptions.from_pb(submit.sampling)
            self._engine.submit(
                (stream, submit.request_id), submit.prompt_token_ids, options, submit.priority
            )
        except (ValueError, ResourceExhausted, ConnectionError) as exc:  # ConnectionError: no pool for now
            code, message = status_for(exc)
            return message, code
        live.add(submit.request_id)
        return None

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after each step."""
        by_stream: defaultdict[int, list[worker_pb2.RequestOutput]] = defaultdict(list)
        for output in outputs:
            stream, request_id = output.key  # type: ignore[misc]
            by_stream[stream].append(output.to_pb(request_id))
        load = self._load()
        for stream, pbs in by_stream.items():
            queue = self._streams.get(stream)
            if queue is not None:
                message = worker_pb2.StepOutputs(outputs=pbs, load=load)
                with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
                    self._loop.call_soon_threadsafe(queue.put_nowait, message)

    def announce_load(self) -> None:
        """Send every stream the load alone, from the event loop: the frontends learn at once that this
        worker stopped or started accepting requests."""
        message = worker_pb2.StepOutputs(load=self._load())
        for queue in self._streams.values():
            queue.put_nowait(message)

    def _load(self) -> worker_pb2.Load:
        running, waiting = self._engine.load()
        usage = self._engine.kv.usage()
        return worker_pb2.Load(
            running=running,
            waiting=waiting,
            kv_pages_in_use=usage.in_use_pages + usage.referenced_pages,
            kv_pages_total=self._engine.kv.num_pages - 1,
            unavailable=self._engine.suspended or "",
        )
