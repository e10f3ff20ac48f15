"""One request's generation, apart from its delivery to the client.

A `Generation` runs a checked request as a task of its own: it waits for an admission slot, tokenizes the
request on the frontend's bounded tokenizer threads, sends it to the least-loaded worker, and turns each
worker output into a GenerateResponse (text deltas from `detokenizer`, stop strings) on a queue. The slot
is released the moment generation ends, whatever the client has read, so a client that never reads
cannot hold the server's capacity; the queue holds at most max_tokens small messages. If the caller stops
listening (the client cancels, its deadline passes, it stalls) `cancel` aborts the request in its worker,
which frees its pages within one step. Should the worker fail instead, the request goes on on another one
from where it was (`failover`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Executor
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2
from services.common.wire import error_of
from services.frontend.admission import Admission, Client
from services.frontend.detokenizer import TextStream
from services.frontend.failover import Progress, next_worker
from services.frontend.identity import ClientIdentity
from services.frontend.metrics import RequestTracker
from services.frontend.router import Output, Router, WorkerDown, WorkerLink
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
        self, request: generation_pb2.GenerateRequest, tracker: RequestTracker, client: Client
    ) -> list[Generation]:
        """Check a request and start generating its samples; a bad request is refused here, before admission.
        client: whose share of admission its samples take (None: the gateway's requests, which have none).

        Sample 0 leads: the others wait for its prompt's ids, then go to its worker, which computes the prompt
        once and finds its full pages in the prefix cache for them.
        """
        limits = self.router.limits()
        check_sizes(request.prompt, request.messages, limits, len(request.prompt_token_ids))
        checked = self.builder.check(request, limits)
        leader = Generation(self, checked, limits, tracker, client)
        return [leader] + [
            Generation(self, checked, limits, tracker, client, (index, leader))
            for index in range(1, checked.n)
        ]

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
        client: Client,
        sample: tuple[int, Generation] | None = None,
    ) -> None:
        """sample: for a sample after the first, its index and the first sample's Generation."""
        self._shared = shared
        self._tracker = tracker
        self._client = client
        self._queue: asyncio.Queue[generation_pb2.GenerateResponse | BaseException | None] = asyncio.Queue()
        self.prompt_tokens = 0  # known once tokenized: before the first response
        self.first_prompt_token = 0  # likewise
        self.index, self._leader = sample or (0, None)  # type: tuple[int, Generation | None]
        # The request as its worker got it, and where: what the later samples follow.
        self.submitted: asyncio.Future[tuple[PreparedRequest, WorkerLink, str]] = asyncio.Future()
        self._task = asyncio.create_task(self._run(checked, limits) if sample is None else self._follow())

    async def responses(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        """Stop generating; a caller still reading `responses` gets a last one that says ABORT."""
        self._task.cancel()

    async def _run(self, checked: CheckedRequest, limits: ModelLimits) -> None:
        async def generate() -> None:
            self._tracker.queued()
            async with self._shared.admission.slot(checked.request.priority, self._client):
                self._tracker.admitted()
                tokenize = functools.partial(self._shared.builder.tokenize, checked, limits)
                await self._generate(await self._shared.run_tokenizer(tokenize))

        await self._reporting(generate())

    async def _follow(self) -> None:
        """A later sample: the first one's request with its own seed, on the first one's worker if it is up.
        It takes its admission slot only once the first has tokenized, so samples never wait on each other
        for slots."""
        first = self._leader
        assert first is not None

        async def generate() -> None:
            leader, link, leader_id = await asyncio.shield(first.submitted)
            async with self._shared.admission.slot(leader.priority, self._client):
                await self._generate(sample_of(leader, self.index), (link, leader_id))

        await self._reporting(generate())

    async def _reporting(self, generation: Coroutine[None, None, None]) -> None:
        """Run generation, ending the queue with its error, or with ABORT when cancelled."""
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
        link = follow[0] if follow and follow[0].accepting else self._shared.router.pick()
        follows = follow[1] if follow and link is follow[0] else ""
        text = TextStream(
            self._shared.tokenizer.backend_tokenizer,
            prepared.prompt_ids,
            prepared.stop,
            prepared.options.min_tokens,
        )
        self.prompt_tokens, self.first_prompt_token = len(prepared.prompt_ids), prepared.prompt_ids[0]
        progress = Progress()
        while True:
            try:
                worker_id, outputs = link.submit(progress.resumed(prepared), follows, progress.token_ids)
                if not self.submitted.done():
                    self.submitted.set_result((prepared, link, worker_id))
                await self._relay(prepared, text, progress, link, worker_id, outputs)
                return
            except WorkerDown as lost:
                link = next_worker(self._shared.router, lost, progress, self._shared.max_failovers)
                follows = ""

    async def _relay(
        self,
        prepared: PreparedRequest,
        text: TextStream,
        progress: Progress,
        link: WorkerLink,
        worker_id: str,
        outputs: asyncio.Queue[Output],
    ) -> None:
        """Turn one worker's outputs for the request into responses, until it ends or the worker is lost."""
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                if isinstance(output, Exception):
                    raise output
                if output.error:
                    raise error_of(output)
                progress.add(output)
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
                    index=self.index,
                    prompt_logprobs=[self._with_text(lp) for lp in output.prompt_logprobs],
                )
                if reason:
                    finished = True
                    _set_matched_stop(response, text.stopped, prepared.options.stop_token_ids)
                    response.usage.prompt_tokens = len(prepared.prompt_ids)
                    response.usage.completion_tokens = len(progress.token_ids)
                    response.usage.cached_prompt_tokens = progress.cached_prompt_tokens or 0
                self._queue.put_nowait(response)
        finally:
            if not finished:
                link.abort(worker_id)  # cancelled, past its deadline, failed, or its worker lost

    def _with_text(self, logprobs: generation_pb2.TokenLogprobs) -> generation_pb2.TokenLogprobs:
        for top in logprobs.top:
            top.text = self._shared.token_text(top.token_id)
        return logprobs


def sample_of(first: PreparedRequest, index: int) -> PreparedRequest:
    """Sample index of a request, as its first sample was prepared: its own seed (seed + index, so the
    same seed gives the same samples), and no prompt log-probabilities, which the first sample returns."""
    options = first.options
    seed = None if options.seed is None else (options.seed + index + (1 << 63)) % (1 << 64) - (1 << 63)
    options = dataclasses.replace(options, seed=seed, prompt_logprobs=None)
    return dataclasses.replace(first, options=options)


async def merged(generations: list[Generation]) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """Every sample's responses, in the order they come (each says its index); the first error ends it."""
    if len(generations) == 1:
        async for response in generations[0].responses():
            yield response
        return
    queue: asyncio.Queue[generation_pb2.GenerateResponse | BaseException | None] = asyncio.Queue()

    async def relay(generation: Generation) -> None:
        try:
            async for response in generation.responses():
                queue.put_nowait(response)
            queue.put_nowait(None)
        except Exception as exc:  # the call fails with it
            queue.put_nowait(exc)

    relays = [asyncio.create_task(relay(generation)) for generation in generations]
    try:
        ended = 0
        while ended < len(relays):
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                ended += 1
            else:
                yield item
    finally:
        for task in relays:
            task.cancel()


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
