"""One request's generation, apart from its delivery to the client.

A `Generation` runs a checked request as a task of its own: it waits for an admission slot, tokenizes the
request on the frontend's bounded tokenizer threads, sends it to the least-loaded worker, and turns each
worker output into a GenerateResponse (text deltas from `detokenizer`, stop strings) on a queue. The slot
is released the moment generation ends, whatever the client has read, so a client that never reads
cannot hold the server's capacity; the queue holds at most max_tokens small messages. If the caller stops
listening (the client cancels, its deadline passes, it stalls) `cancel` aborts the request in its worker,
which frees its pages within one step.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2
from services.common.wire import error_of
from services.frontend.admission import Admission
from services.frontend.detokenizer import TextStream
from services.frontend.metrics import RequestTracker
from services.frontend.router import Router
from services.frontend.validation import (
    CheckedRequest,
    ModelLimits,
    PreparedRequest,
    RequestBuilder,
    check_sizes,
)

Reason = generation_pb2.GenerateResponse.FinishReason
_END = None  # the queue's last item, after the final response
T = TypeVar("T")


class Shared:
    """What every generation shares: the router, admission, the request builder and its threads."""

    def __init__(self, router: Router, admission: Admission, builder: RequestBuilder, tokenizing: Executor):
        self.router = router
        self.admission = admission
        self.builder = builder
        self.tokenizer: PreTrainedTokenizerBase = builder.tokenizer
        self.tokenizing = tokenizing

    async def run_tokenizer(self, function: Callable[[], T]) -> T:
        """Off the event loop, on the bounded tokenizer threads: a long prompt takes a while."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, function)

    def start(self, request: generation_pb2.GenerateRequest, tracker: RequestTracker) -> Generation:
        """Check a request and start generating it; a bad request is refused here, before admission."""
        limits = self.router.limits()
        check_sizes(request.prompt, request.messages, limits, len(request.prompt_token_ids))
        return Generation(self, self.builder.check(request, limits), limits, tracker)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one per process, and the cache is the point
    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


class Generation:
    def __init__(
        self,
        shared: Shared,
        checked: CheckedRequest,
        limits: ModelLimits,
        tracker: RequestTracker,
    ) -> None:
        self._shared = shared
        self._tracker = tracker
        self._queue: asyncio.Queue[generation_pb2.GenerateResponse | BaseException | None] = asyncio.Queue()
        self.prompt_tokens = 0  # known once tokenized: before the first response
        self._task = asyncio.create_task(self._run(checked, limits))

    async def responses(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        """Stop generating; a caller still reading `responses` gets a last one that says ABORT."""
        self._task.cancel()

    async def _run(self, checked: CheckedRequest, limits: ModelLimits) -> None:
        try:
            self._tracker.queued()
            async with self._shared.admission.slot(checked.request.priority):
                self._tracker.admitted()
                tokenize = functools.partial(self._shared.builder.tokenize, checked, limits)
                await self._generate(await self._shared.run_tokenizer(tokenize))
        except Exception as exc:  # delivered to the caller, which reports it
            self._queue.put_nowait(exc)
        except asyncio.CancelledError:
            self._queue.put_nowait(generation_pb2.GenerateResponse(finish_reason=Reason.ABORT))
            self._queue.put_nowait(_END)
            raise
        self._queue.put_nowait(_END)

    async def _generate(self, prepared: PreparedRequest) -> None:
        link = self._shared.router.pick()
        worker_id, outputs = link.submit(prepared)
        self.prompt_tokens = len(prepared.prompt_ids)
        text = TextStream(self._shared.tokenizer.backend_tokenizer, prepared.prompt_ids, prepared.stop)
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
                    _set_matched_stop(response, text.stopped, prepared.options.stop_token_ids)
                    response.usage.prompt_tokens = len(prepared.prompt_ids)
                    response.usage.completion_tokens = completion_tokens
                    response.usage.cached_prompt_tokens = output.cached_prompt_tokens
                self._queue.put_nowait(response)
        finally:
            if not finished:
                link.abort(worker_id)  # cancelled, past its deadline, or failed

    def _with_text(self, logprobs: generation_pb2.TokenLogprobs) -> generation_pb2.TokenLogprobs:
        for top in logprobs.top:
            top.text = self._shared.token_text(top.token_id)
        return logprobs


def _set_matched_stop(
    response: generation_pb2.GenerateResponse, stop_string: str, stop_token_ids: tuple[int, ...]
) -> None:
    """Say what stopped a request that ended with STOP, as vLLM's stop_reason does (nothing for an EOS)."""
    if response.finish_reason != Reason.STOP:
        return
    if stop_string:
        response.matched_stop_str = stop_string
    elif response.token_ids and response.token_ids[-1] in stop_token_ids:
        response.matched_token_id = response.token_ids[-1]
