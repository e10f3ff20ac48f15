"""The public Generation servicer.

A request is checked and tokenized, waits for an admission slot, goes to the least-loaded worker, and
streams back one message per engine step that produced text or tokens. The last message carries the finish
reason and usage. If the call ends early (the client cancels, its deadline passes, or a stop string is
found) the request is aborted in its worker, which frees its pages within one step.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import grpc
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.common.wire import error_of
from services.frontend.admission import Admission
from services.frontend.detokenizer import TextStream
from services.frontend.metrics import RequestTracker
from services.frontend.router import Router
from services.frontend.validation import PreparedRequest, RequestBuilder

Reason = generation_pb2.GenerateResponse.FinishReason


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        router: Router,
        admission: Admission,
        builder: RequestBuilder,
        model_id: str,
    ) -> None:
        self._router = router
        self._admission = admission
        self._builder = builder
        self._tokenizer: PreTrainedTokenizerBase = builder.tokenizer
        self._model_id = model_id

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        with RequestTracker(context) as tracker:
            async for response in self._generate(await self._prepare(request), tracker):
                yield response

    async def Complete(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        whole = generation_pb2.GenerateResponse()
        with RequestTracker(context) as tracker:
            async for response in self._generate(await self._prepare(request), tracker):
                whole.request_id = response.request_id
                whole.text += response.text
                whole.token_ids.extend(response.token_ids)
                whole.logprobs.extend(response.logprobs)
                whole.finish_reason = response.finish_reason
                if response.HasField("usage"):
                    whole.usage.CopyFrom(response.usage)
        return whole

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        if bool(request.text) == bool(request.messages):
            raise InvalidArgument("set exactly one of text or messages")
        if request.messages:
            ids = await asyncio.to_thread(self._builder.prompt_ids, "", [], list(request.messages))
        else:
            encoded = await asyncio.to_thread(
                self._tokenizer, request.text, add_special_tokens=request.add_special_tokens
            )
            ids = encoded["input_ids"]
        return generation_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        info = generation_pb2.ModelInfo(model_id=self._model_id)
        worker = next((link.info for link in self._router.links if link.serves_model), None)
        if worker is not None:  # the model's limits, and how it runs, are the workers' to say
            info.max_context_length, info.vocab_size = worker.max_model_len, worker.vocab_size
            info.eos_token_ids.extend(worker.eos_token_ids)
            info.dtype, info.device, info.page_size = worker.dtype, worker.device, worker.page_size
        return info

    async def _prepare(self, request: generation_pb2.GenerateRequest) -> PreparedRequest:
        # Off the event loop: a prompt of megabytes takes seconds to tokenize, and every other stream and
        # health check would wait for it. The tokenizer's settings never change, so threads share it safely.
        return await asyncio.to_thread(self._builder.prepare, request, self._router.limits())

    async def _generate(
        self, prepared: PreparedRequest, tracker: RequestTracker
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        tracker.queued()
        async with self._admission.slot(prepared.priority):
            tracker.admitted()
            link = self._router.pick()
            worker_id, outputs = link.submit(prepared.prompt_ids, prepared.options, prepared.priority)
            text = TextStream(self._tokenizer.backend_tokenizer, prepared.prompt_ids, prepared.stop)
            completion_tokens = 0
            finished = False
            try:
                while not finished:
                    output = await outputs.get()
                    if isinstance(output, Exception):
                        raise output
                    if output.error:
                        raise error_of(output)
                    completion_tokens += len(output.token_ids)
                    delta = text.push(output.token_ids)
                    reason = output.finish_reason
                    if text.stopped and not reason:
                        reason = Reason.STOP  # a stop string: the worker need not go on
                        link.abort(worker_id)
                    elif reason:
                        delta += text.finish()
                    response = generation_pb2.GenerateResponse(
                        request_id=prepared.request_id,
                        text=delta,
                        token_ids=output.token_ids,
                        logprobs=[self._with_text(lp) for lp in output.logprobs],
                        finish_reason=reason,
                    )
                    if reason:
                        finished = True
                        response.usage.prompt_tokens = len(prepared.prompt_ids)
                        response.usage.completion_tokens = completion_tokens
                        response.usage.cached_prompt_tokens = output.cached_prompt_tokens
                    tracker.responded(response)
                    yield response
            finally:
                if not finished:
                    link.abort(worker_id)  # cancelled, past its deadline, or failed

    def _with_text(self, logprobs: generation_pb2.TokenLogprobs) -> generation_pb2.TokenLogprobs:
        for top in logprobs.top:
            top.text = self._token_text(top.token_id)
        return logprobs

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one service per process, and the cache is the point
    def _token_text(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id]))
