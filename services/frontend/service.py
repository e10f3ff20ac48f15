"""The public Generation servicer.

A request runs in a `call.Call`: its sizes are checked before anything else (so an oversized prompt is
refused in microseconds, before any tokenizer sees it); then each sample (`generation.Sample`) takes an
admission slot, is tokenized on the bounded tokenizer threads and runs on the least-loaded worker, and the
call streams one message per engine step that produced text or tokens, the last with the finish reason and
usage. If the call ends early (the client cancels, its deadline passes, it does not read, or a stop string
is found) the request is aborted in its worker, which frees its pages within one step.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager

import grpc

from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.common.request import check_text_fits
from services.frontend.call import Call, CallFrame
from services.frontend.generation import RequestPipeline
from services.frontend.validation import request_id_of, text_length


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, pipeline: RequestPipeline, model_id: str, drain_timeout_s: float) -> None:
        self._pipeline = pipeline
        self._router = pipeline.router
        self._model_id = model_id
        self._calls = CallFrame(pipeline, drain_timeout_s)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        with self._open(request, context) as call:
            async for response in call.responses():
                await call.deliver(response)

    async def Complete(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        if request.sampling.n > 1:
            raise InvalidArgument("Complete returns one completion: use Generate for n > 1 samples")
        whole = generation_pb2.GenerateResponse()
        with self._open(request, context) as call:
            async for response in call.responses():
                whole.request_id = response.request_id
                whole.text += response.text
                whole.token_ids.extend(response.token_ids)
                whole.logprobs.extend(response.logprobs)
                whole.prompt_logprobs.extend(response.prompt_logprobs)
                whole.finish_reason = response.finish_reason
                if response.HasField("usage"):
                    whole.usage.CopyFrom(response.usage)
        return whole

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        if bool(request.text) == bool(request.messages):
            raise InvalidArgument("set exactly one of text or messages")
        check_text_fits(text_length(request.text, request.messages), self._router.limits())
        builder = self._pipeline.builder
        if request.messages:
            work = functools.partial(builder.prompt_ids, "", [], list(request.messages))
        else:
            work = functools.partial(builder.text_ids, request.text, request.add_special_tokens)
        async with self._pipeline.admission.slot(0, self._pipeline.clients.of(context)):
            ids = await self._pipeline.run_tokenizer(work)
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

    def _open(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AbstractContextManager[Call]:
        client = self._pipeline.clients.of(context)
        return self._calls.open(request, request_id_of(request.request_id), context, client)
