"""A request's samples as they run, apart from their delivery to the client (`call`).

The `RequestPipeline` is what every request runs through: it checks a request (refusing a bad one before
admission) and starts its samples. Each `Sample` runs as a task of its own: it waits for an admission slot,
tokenizes the request on the frontend's bounded tokenizer threads, sends it to the least-loaded worker, and
turns each worker output into a GenerateResponse (text deltas from `detokenizer`, stop strings) on a queue.
The slot is released the moment the sample ends, whatever the client has read, so a client that never reads
cannot hold the server's capacity; the queue holds at most max_tokens small messages. If the caller stops
listening (the client cancels, its deadline passes, it stalls) `cancel` aborts the request in its worker,
which frees its pages within one step. Should the worker fail instead, the request goes on on another one
from where it was (`failover`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2
from services.common.request import ModelLimits
from services.common.wire import error_of
from services.frontend.admission import Admission, Client
from services.frontend.detokenizer import TextStream
from services.frontend.failover import Progress, next_worker
from services.frontend.identity import ClientIdentity
from services.frontend.metrics import RequestTracker
from services.frontend.router import Output, Router, WorkerDown, WorkerLink
from services.frontend.validation import CheckedRequest, PreparedRequest, RequestBuilder

Reason = generation_pb2.GenerateResponse.FinishReason
_END = None  # the queue's last item, after the final response
T = TypeVar("T")


class RequestPipeline:
    """What every request runs through, whichever protocol it came by: the router to the workers, admission,
    the request builder and the tokenizer threads it runs on, and who a call's client is."""

    def __init__(
        self,
        router: Router,
        admission: Admission,
        builder: RequestBuilder,
        tokenizing: Executor,
        clients: ClientIdentity,
        max_failovers: int = 0,
    ):
        """clients: who a public call's client is, for its share of admission; max_failovers: how many
        times a request may move to another worker when its own fails."""
        self.router = router
        self.max_failovers = max_failovers
        self.admission = admission
        self.builder = builder
        self.clients = clients
        self.tokenizer: PreTrainedTokenizerBase = builder.tokenizer
        self.tokenizing = tokenizing

    async def run_tokenizer(self, function: Callable[[], T]) -> T:
        """Off the event loop, on the bounded tokenizer threads: a long prompt takes a while."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, function)

    def start(
        self,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        tracker: RequestTracker,
        client: Client,
        *,
        with_text: bool = True,
    ) -> list[Sample]:
        """Check a request and start its samples; a bad request is refused here, before admission.
        client: whose share of admission its samples take (None: the gateway's requests, which have none);
        with_text: whether the client reads text, or token ids alone (then a sample decodes text only to
        find its stop strings).

        Sample 0 leads: the others wait for its prompt's ids, then go to its worker, which computes the prompt
        once and finds its full pages in the prefix cache for them.
        """
        limits = self.router.limits()
        checked = self.builder.check(request, request_id, limits)
        if checked.cache_ttl_seconds:
            checked = dataclasses.replace(checked, tenant=self.clients.tenant(client, checked.cache_salt))
        sample = functools.partial(
            Sample, self, checked, limits, tracker=tracker, client=client, with_text=with_text
        )
        leader = sample()
        return [leader] + [sample(leader=(index, leader)) for index in range(1, checked.n)]

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one per process, and the cache is the point
    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


class Sample:
    """One sample of a request, run as a task of its own; `responses` are its answers, in order."""

    def __init__(
        self,
        pipeline: RequestPipeline,
        checked: CheckedRequest,
        limits: ModelLimits,
        *,
        tracker: RequestTracker,
        client: Client,
        with_text: bool,
        leader: tuple[int, Sample] | None = None,
    ) -> None:
        """leader: for a sample after the first, its index and the first sample."""
        self._pipeline = pipeline
        self._limits = limits
        self._tracker = tracker
        self._client = client
        self._with_text = with_text
        self._queue: asyncio.Queue[generation_pb2.GenerateResponse | BaseException | None] = asyncio.Queue()
        self.prompt_tokens = 0  # known once tokenized: before the first response
        self.first_prompt_token = 0  # likewise
        self.index, self._leader = leader or (0, None)  # type: tuple[int, Sample | None]
        # The request as its worker got it, and where: what the later samples follow.
        self.submitted: asyncio.Future[tuple[PreparedRequest, WorkerLink, str]] = asyncio.Future()
        self._task = asyncio.create_task(self._run(checked) if leader is None else self._follow())

    async def responses(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        """Stop generating; a caller still reading `responses` gets a last one that says ABORT."""
        self._task.cancel()

    async def _run(self, checked: CheckedRequest) -> None:
        async def generate() -> None:
            self._tracker.queued()
            async with self._pipeline.admission.slot(checked.request.priority, self._client):
                self._tracker.admitted()
                tokenize = functools.partial(self._pipeline.builder.tokenize, checked, self._limits)
                await self._generate(await self._pipeline.run_tokenizer(tokenize))

        await self._reporting(generate())

    async def _follow(self) -> None:
        """A later sample: the first one's request with its own seed, on the first one's worker if it is up.
        It takes its admission slot only once the first has tokenized, so samples never wait on each other
        for slots."""
        first = self._leader
        assert first is not None

        async def generate() -> None:
            leader, link, leader_id = await asyncio.shield(first.submitted)
            async with self._pipeline.admission.slot(leader.engine.priority, self._client):
                await self._generate(sample_of(leader, self.index), (link, leader_id))

        await self._reporting(generate())

    async def _reporting(self, generation: Coroutine[None, None, None]) -> None:
        """Run the sample, ending the queue with its error, or with ABORT when cancelled."""
        try:
            await generation
        except Exception as exc:  # delivered to the caller, which reports it
            self.submitted.cancel()  # the later samples end too (a no-op once they are on their way)
            self._queue.put_nowait(exc)
        except asyncio.CancelledError:
            self.submitted.cancel()
            self._queue.put_nowait(
                generation_pb2.GenerateResponse(finish_reason=Reason.ABORT, index=self.index)
            )
            self._queue.put_nowait(_END)
            raise
        self._queue.put_nowait(_END)

    async def _generate(
        self, prepared: PreparedRequest, follow: tuple[WorkerLink, str] | None = None
    ) -> None:
        """Run the request on a worker, and on another one from where it was should that worker fail."""
        link = follow[0] if follow and follow[0].accepting else self._pipeline.router.pick()
        engine = prepared.engine
        request = dataclasses.replace(engine, follows=follow[1] if follow and link is follow[0] else "")
        text = self._text_stream(prepared)
        self.prompt_tokens, self.first_prompt_token = len(engine.prompt_ids), engine.prompt_ids[0]
        progress = Progress()
        while True:
            try:
                worker_id, outputs = link.submit(request)
                if not self.submitted.done():
                    self.submitted.set_result((prepared, link, worker_id))
                await self._relay(prepared, text, progress, link, worker_id, outputs)
                return
            except WorkerDown as lost:
                link = next_worker(self._pipeline.router, lost, progress, self._pipeline.max_failovers)
                request = progress.resumed(engine)

    def _text_stream(self, prepared: PreparedRequest) -> TextStream | None:
        """The sample's detokenizer; None when no one would read its text: a client that reads token ids
        alone, and no stop strings to look for."""
        if not (self._with_text or prepared.stop):
            return None
        prompt_ids = prepared.engine.prompt_ids
        # The context's end ends the request whatever min_tokens says, so stop strings count from there on.
        room = self._limits.max_model_len - len(prompt_ids)
        min_tokens = min(prepared.engine.options.min_tokens, room)
        return TextStream(self._pipeline.tokenizer.backend_tokenizer, prompt_ids, prepared.stop, min_tokens)

    async def _relay(
        self,
        prepared: PreparedRequest,
        text: TextStream | None,
        progress: Progress,
        link: WorkerLink,
        worker_id: str,
        outputs: asyncio.Queue[Output],
    ) -> None:
        """Turn one worker's outputs for the request into responses, until it ends or the worker is lost."""
        worker_ended = False
        try:
            while True:
                output = await outputs.get()
                if isinstance(output, Exception):
                    raise output
                if output.error:
                    raise error_of(output)
                worker_ended = bool(output.finish_reason)
                response = self._response(prepared, text, output)
                progress.add(output, response.token_ids)
                if response.finish_reason:
                    response.usage.prompt_tokens = len(prepared.engine.prompt_ids)
                    response.usage.completion_tokens = len(progress.token_ids)
                    response.usage.cached_prompt_tokens = progress.cached_prompt_tokens or 0
                self._queue.put_nowait(response)
                if response.finish_reason:
                    return
        finally:
            if not worker_ended:
                # A stop string, a cancel, a passed deadline, an error, or its worker lost.
                link.abort(worker_id)

    def _response(
        self, prepared: PreparedRequest, text: TextStream | None, output: worker_pb2.RequestOutput
    ) -> generation_pb2.GenerateResponse:
        """The response to one output of the worker: its tokens, and their text for a client that reads it.
        An output may hold several tokens (a speculative step's): the text takes them one by one, and a stop
        string ends the response at the token that completed it."""
        reason, delta, kept = output.finish_reason, "", len(output.token_ids)
        if text is not None:
            for count, token_id in enumerate(output.token_ids, 1):
                delta += text.push([token_id])
                if text.stopped:
                    kept = count
                    break
            if text.stopped and (not reason or kept < len(output.token_ids)):
                reason = Reason.STOP  # a stop string: the worker need not go on
            elif reason:
                delta += text.finish()
        response = generation_pb2.GenerateResponse(
            request_id=prepared.request_id,
            text=delta,
            token_ids=output.token_ids[:kept],
            logprobs=self._logprobs(output.logprobs[:kept]),
            finish_reason=reason,
            index=self.index,
            prompt_logprobs=self._logprobs(output.prompt_logprobs),
        )
        if reason:
            stop_string = "" if text is None else text.stopped
            _set_matched_stop(response, stop_string, prepared.engine.options.stop_token_ids)
        return response

    def _logprobs(
        self, entries: Sequence[generation_pb2.TokenLogprobs]
    ) -> Sequence[generation_pb2.TokenLogprobs]:
        """The entries, with their top tokens' text for a client that reads text."""
        if self._with_text:
            for entry in entries:
                for top in entry.top:
                    top.text = self._pipeline.token_text(top.token_id)
        return entries


def sample_of(first: PreparedRequest, index: int) -> PreparedRequest:
    """Sample index of a request, as its first sample was prepared: its own seed (seed + index, so the
    same seed gives the same samples), and no prompt log-probabilities, which the first sample returns."""
    options = first.engine.options
    seed = None if options.seed is None else (options.seed + index + (1 << 63)) % (1 << 64) - (1 << 63)
    options = dataclasses.replace(options, seed=seed, prompt_logprobs=None)
    return dataclasses.replace(first, engine=dataclasses.replace(first.engine, options=options))


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
