"""One public call's frame, the same for both protocols' servicers (`service`, `vllm_service`).

A call's request starts its samples under the call's `RequestTracker`; their responses come merged, in the
order they come (each says its sample's index); each message must reach the client within --drain-timeout,
or the call is cancelled and counted, so that a client that never reads holds neither a slot nor memory for
long. However the call ends (the client cancels, its deadline passes, it does not read, an error), every
sample still running is cancelled on the way out, which aborts it in its worker and frees its pages within
one step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import grpc
from google.protobuf.message import Message

from pagedserve.v1 import generation_pb2
from services.frontend.admission import Client
from services.frontend.generation import RequestPipeline, Sample
from services.frontend.metrics import SLOW_READERS, RequestTracker

log = logging.getLogger(__name__)


class CallFrame:
    def __init__(self, pipeline: RequestPipeline, drain_timeout_s: float, *, with_text: bool = True) -> None:
        """with_text: whether the protocol's clients read text, or token ids alone."""
        self._pipeline = pipeline
        self._drain_timeout_s = drain_timeout_s
        self._with_text = with_text

    @contextmanager
    def open(
        self,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        context: grpc.aio.ServicerContext,
        client: Client,
    ) -> Iterator[Call]:
        """The call, its samples started (a bad request is refused here), for the length of the block."""
        with RequestTracker(context) as tracker:
            samples = self._pipeline.start(request, request_id, tracker, client, with_text=self._with_text)
            call = Call(context, tracker, samples, self._drain_timeout_s)
            try:
                yield call
            finally:
                call.cancel()


class Call:
    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        tracker: RequestTracker,
        samples: list[Sample],
        drain_timeout_s: float,
    ) -> None:
        self.samples = samples
        self._context = context
        self._tracker = tracker
        self._drain_timeout_s = drain_timeout_s

    def cancel(self) -> None:
        """End every sample still running; the call's responses end with one that says ABORT for each."""
        for sample in self.samples:
            sample.cancel()

    async def responses(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Every sample's responses, in the order they come; the first error ends them."""
        if len(self.samples) == 1:
            async for response in self.samples[0].responses():
                self._tracker.responded(response)
                yield response
            return
        queue: asyncio.Queue[generation_pb2.GenerateResponse | BaseException | None] = asyncio.Queue()

        async def relay(sample: Sample) -> None:
            try:
                async for response in sample.responses():
                    queue.put_nowait(response)
                queue.put_nowait(None)
            except Exception as exc:  # the call fails with it
                queue.put_nowait(exc)

        relays = [asyncio.create_task(relay(sample)) for sample in self.samples]
        try:
            ended = 0
            while ended < len(relays):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    ended += 1
                else:
                    self._tracker.responded(item)
                    yield item
        finally:
            for task in relays:
                task.cancel()

    async def deliver(self, message: Message) -> None:
        """Write one message of the call's stream; cancel the call if the client has not read it in time."""
        try:
            await asyncio.wait_for(self._context.write(message), self._drain_timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            # A write is stuck in gRPC, so no status can follow it: cancelling the handler resets the stream.
            SLOW_READERS.inc()
            log.warning("cancelled a stream whose client did not read it for %gs", self._drain_timeout_s)
            raise asyncio.CancelledError from None
        except Exception as exc:
            # A write fails only once the call is over: the client cancelled or reset the stream while the
            # message was on its way. gRPC says so with an error of its own (cygrpc's ExecuteBatchError),
            # before the call reads as cancelled; it is the client's cancel, not a bug of ours.
            log.debug("a write failed, the call is over: %r", exc)
            raise asyncio.CancelledError from None
