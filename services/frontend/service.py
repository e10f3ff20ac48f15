"""The public Generation servicer.

A request's sizes are checked before anything else (so an oversized prompt is refused in microseconds,
before any tokenizer sees it); then it runs as a `generation.Generation`: an admission slot, tokenization
on the bounded tokenizer threads, the least-loaded worker, one message per engine step that produced text
or tokens, the last with the finish reason and usage. Delivery is this module's: each message must reach
the client within --drain-timeout, or the call is cancelled and counted, so that a client that never reads
holds neither a slot nor memory for long. If the call ends early (the client cancels, its deadline passes,
it does not read, or a stop string is found) the request is aborted in its worker, which frees its pages
within one step.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from google.protobuf.message import Message

from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.frontend.generation import Shared, merged
from services.frontend.metrics import SLOW_READERS, RequestTracker
from services.frontend.validation import check_sizes

log = logging.getLogger(__name__)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, shared: Shared, model_id: str, drain_timeout_s: float) -> None:
        self._shared = shared
        self._router = shared.router
        self._model_id = model_id
        self._drain_timeout_s = drain_timeout_s

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        with RequestTracker(context) as tracker:
            generations = self._shared.start(request, tracker, self._shared.clients.of(context))
            try:
                async for response in merged(generations):
                    tracker.responded(response)
                    await deliver(context, response, self._drain_timeout_s)
            finally:
                for generation in generations:
                    generation.cancel()

    async def Complete(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        if request.sampling.n > 1:
            raise InvalidArgument("Complete returns one completion: use Generate for n > 1 samples")
        whole = generation_pb2.GenerateResponse()
        with RequestTracker(context) as tracker:
            (generation,) = self._shared.start(request, tracker, self._shared.clients.of(context))
            try:
                async for response in generation.responses():
                    tracker.responded(response)
                    whole.request_id = response.request_id
                    whole.text += response.text
                    whole.token_ids.extend(response.token_ids)
                    whole.logprobs.extend(response.logprobs)
                    whole.prompt_logprobs.extend(response.prompt_logprobs)
                    whole.finish_reason = response.finish_reason
                    if response.HasField("usage"):
                        whole.usage.CopyFrom(response.usage)
            finally:
                generation.cancel()
        return whole

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        if bool(request.text) == bool(request.messages):
            raise InvalidArgument("set exactly one of text or messages")
        check_sizes(request.text, request.messages, self._router.limits())
        builder = self._shared.builder
        if request.messages:
            work = functools.partial(builder.prompt_ids, "", [], list(request.messages))
        else:
            work = functools.partial(builder.text_ids, request.text, request.add_special_tokens)
        async with self._shared.admission.slot(0, self._shared.clients.of(context)):
            ids = await self._shared.run_tokenizer(work)
        return generation_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        info = generation_pb2.ModelInfo(model_id=self._model_id)
        worker = self._router.worker_info()
        if worker is not None:  # the model's limits, and how it runs, are the workers' to say
            info.max_context_length, info.vocab_size = worker.max_model_len, worker.vocab_size
            info.eos_token_ids.extend(worker.eos_token_ids)
            info.dtype, info.device, info.page_size = worker.dtype, worker.device, worker.page_size
        return info


async def deliver(context: grpc.aio.ServicerContext, message: Message, drain_timeout_s: float) -> None:
    """Write one message of a stream, or cancel the call if the client has not read it in drain_timeout_s."""
    try:
        await asyncio.wait_for(context.write(message), drain_timeout_s)
    except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
        # A write is stuck in gRPC, so no status can follow it: cancelling the handler resets the stream.
        SLOW_READERS.inc()
        log.warning("cancelled a stream whose client did not read it for %gs", drain_timeout_s)
        raise asyncio.CancelledError from None
    except Exception as exc:
        # A write fails only once the call is over: the client cancelled or reset the stream while the message
        # was on its way. gRPC says so with an error of its own (cygrpc's ExecuteBatchError), before the call
        # reads as cancelled; it is the client's cancel, not a bug of ours.
        log.debug("a write failed, the call is over: %r", exc)
        raise asyncio.CancelledError from None
