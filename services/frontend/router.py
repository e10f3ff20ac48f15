"""Workers as the frontend sees them: one multiplexed Connect stream each, and least-loaded routing.

A WorkerLink keeps its stream open and reconnects with backoff when it breaks. A worker sends its load at
least every HEARTBEAT_S; one silent for SILENT_AFTER_S (frozen, or its event loop stuck) gets no new
requests until it speaks again. Everything queued for sending while a call is in flight goes out as one
WorkerRequest. Each request's outputs arrive on its own asyncio queue; when the worker goes away, or stays
silent past the link's timeout, every request it had gets WorkerDown at once, and the generation moves it to
another worker (`failover`); a silent worker is also told to abort them, should it wake. A worker that is
connected but refuses new requests (its KV pool is out of reach) says so in its load, and gets none until it
says otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from pagedserve.plumbing.auth import secret_metadata
from pagedserve.plumbing.errors import Unavailable
from pagedserve.plumbing.rpc import CHANNEL_OPTIONS, check_peer_before_secret
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.request import EngineRequest, ModelLimits
from services.common.wire import SILENT_AFTER_S, submit_pb

log = logging.getLogger(__name__)


class WorkerDown(Unavailable):
    """The worker serving a request went away mid-request."""


class OtherModel(Exception):
    """The worker serves a model other than the frontend's."""


Output = worker_pb2.RequestOutput | WorkerDown


class WorkerLink:
    def __init__(
        self,
        address: str,
        model_id: str,
        on_change: Callable[[], None],
        secret: str | None,
        timeout_s: float,
    ) -> None:
        """timeout_s: how long the worker may be silent before its requests are taken from it."""
        self.address = address
        self._timeout_s = timeout_s
        self._metadata = secret_metadata(secret)
        self.model_id = model_id
        self.up = False
        self.down_reason = "not reached yet"  # why it is not up, for the log and for clients
        self.info: worker_pb2.WorkerInfo | None = None
        self.load = worker_pb2.Load()
        self.last_heard = 0.0  # when the worker last sent a message, by time.monotonic()
        self.silent = False
        self._on_change = on_change
        self._outbox: asyncio.Queue[worker_pb2.WorkerRequest] = asyncio.Queue()
        self._requests: dict[str, asyncio.Queue[Output]] = {}
        self._ids = itertools.count()
        self._task: asyncio.Task[None] | None = None

    @property
    def outstanding(self) -> int:
        return len(self._requests)

    @property
    def serves_model(self) -> bool:
        """Whether the worker has said that it serves the frontend's model."""
        return self.info is not None and self.info.model_id == self.model_id

    @property
    def accepting(self) -> bool:
        return self.up and not self.load.unavailable and not self.silent

    @property
    def refusing(self) -> str:
        """Why a worker that is up takes no requests now; empty when it takes them."""
        if self.silent:
            return f"it has sent nothing for {time.monotonic() - self.last_heard:.0f}s"
        return self.load.unavailable

    def check_silence(self) -> None:
        """Note that the worker went silent, or spoke again, and take its requests from it once it has been
        silent for the timeout; called every half second."""
        quiet = time.monotonic() - self.last_heard
        silent = self.up and quiet > min(SILENT_AFTER_S, self._timeout_s)
        if silent != self.silent:
            self.silent = silent
            log.warning("worker %s: %s", self.address, self.refusing or "speaks again")
            self._on_change()
        if silent and quiet > self._timeout_s and self._requests:
            log.warning("worker %s: silent for %.1fs; moving its requests", self.address, quiet)
            self._outbox.put_nowait(worker_pb2.WorkerRequest(abort=list(self._requests)))  # should it wake
            self._drop_requests(f"has sent nothing for {quiet:.1f}s")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"worker-link {self.address}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, request: EngineRequest) -> tuple[str, asyncio.Queue[Output]]:
        """Send a request to the worker; returns its id on this stream (the stream's sequence number, which
        a later sample of the same prompt names in its `follows`) and the queue of its outputs."""
        if not self.up:
            raise WorkerDown(f"worker {self.address} is down")
        request_id = str(next(self._ids))
        queue: asyncio.Queue[Output] = asyncio.Queue()
        self._requests[request_id] = queue
        self._outbox.put_nowait(worker_pb2.WorkerRequest(submit=[submit_pb(request_id, request)]))
        return request_id, queue

    def abort(self, request_id: str) -> None:
        """Stop a request the caller no longer wants; the worker frees its pages within a step."""
        if self._requests.pop(request_id, None) is not None:
            self._outbox.put_nowait(worker_pb2.WorkerRequest(abort=[request_id]))

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            reason, unreachable = "not reachable", False
            try:
                await self._session()
                reason = "the stream ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
                unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE
            except OtherModel as exc:
                reason = str(exc)
            if self.up:
                log.warning("worker %s went away: %s", self.address, reason)
                backoff = 0.05
            elif reason != self.down_reason:  # once a reason, not at every retry
                # Nothing listening yet where no worker was ever reached: it is likely starting beside this
                # frontend (`up` starts them so).
                starting = unreachable and self.info is None
                level = logging.INFO if starting else logging.WARNING
                log.log(level, "worker %s is not up: %s", self.address, reason)
            self.down_reason = reason
            self._set_down(reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _session(self) -> None:
        await check_peer_before_secret(self.address)  # a unix socket: no other user's process behind it
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            self.info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5, metadata=self._metadata)
            if self.info.model_id != self.model_id:
                raise OtherModel(
                    f"it serves {self.info.model_id}, not {self.model_id}: a frontend and its workers take "
                    "one --model-id, or none"
                )
            self._outbox = asyncio.Queue()
            call = stub.Connect(self._outgoing(), metadata=self._metadata)
            try:
                await self._receive(call, self.info.worker_name)
            finally:
                call.cancel()  # stops gRPC's task that reads _outgoing, before the channel closes

    async def _receive(self, messages: AsyncIterator[worker_pb2.StepOutputs], name: str) -> None:
        """Take the worker's messages until its stream ends: its load, and its requests' outputs."""
        messages = aiter(messages)
        try:
            self.load = (await anext(messages)).load  # the worker's first message: its load alone
        except StopAsyncIteration:
            return
        self.last_heard = time.monotonic()
        self.up = True
        log.info("worker %s (%s) is up", self.address, name)
        if self.load.unavailable:
            log.warning("worker %s refuses requests for now: %s", self.address, self.load.unavailable)
        self._on_change()
        async for message in messages:
            self.last_heard = time.monotonic()
            self.check_silence()
            accepted, self.load = self.accepting, message.load
            if self.accepting != accepted:
                change = self.load.unavailable or "accepts requests again"
                log.warning("worker %s: %s", self.address, change)
                self._on_change()
            for output in message.outputs:
                queue = self._requests.get(output.request_id)
                if queue is None:
                    continue  # aborted by the frontend: its last outputs are not wanted
                if output.finish_reason:
                    del self._requests[output.request_id]
                queue.put_nowait(output)

    async def _outgoing(self) -> AsyncIterator[worker_pb2.WorkerRequest]:
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            yield worker_pb2.WorkerRequest(
                submit=[s for request in batch for s in request.submit],
                abort=[a for request in batch for a in request.abort],
            )

    def _set_down(self, reason: str) -> None:
        was_up, self.up, self.silent = self.up, False, False
        self._drop_requests(f"went away ({reason})")
        if was_up:
            self._on_change()

    def _drop_requests(self, what: str) -> None:
        for queue in self._requests.values():
            queue.put_nowait(WorkerDown(f"the worker at {self.address} {what} mid-request"))
        self._requests.clear()


class Router:
    def __init__(
        self,
        addresses: Sequence[str],
        model_id: str,
        on_change: Callable[[], None],
        *,
        timeout_s: float,
        secret: str | None = None,
    ) -> None:
        """timeout_s: how long a worker may be silent before its requests move to another."""
        if not addresses:
            raise ValueError("the frontend needs at least one worker address")  # FrontendConfig checks it
        self.links = [WorkerLink(address, model_id, on_change, secret, timeout_s) for address in addresses]
        self._watch: asyncio.Task[None] | None = None

    @property
    def any_up(self) -> bool:
        """Whether some worker accepts requests."""
        return any(link.accepting for link in self.links)

    @property
    def all_up(self) -> bool:
        """Whether every worker accepts requests."""
        return all(link.accepting for link in self.links)

    def start(self) -> None:
        for link in self.links:
            link.start()
        self._watch = asyncio.create_task(self._watch_silence(), name="worker silence")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(link.stop() for link in self.links))

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for link in self.links:
                link.check_silence()

    def pick(self) -> WorkerLink:
        """The least-loaded worker that is up: fewest requests of ours in flight, then most free pages."""
        up = [link for link in self.links if link.accepting]
        if up:
            return min(up, key=lambda link: (link.outstanding, link.load.kv_pages_in_use))
        refusing = [f"{link.address}: {link.refusing}" for link in self.links if link.up]
        if refusing:
            raise Unavailable(f"no worker accepts requests now ({'; '.join(refusing)})")
        why = "; ".join(f"{link.address}: {link.down_reason}" for link in self.links)
        raise Unavailable(f"no worker is up ({why}); start one with `pagedserve worker`")

    def worker_info(self) -> worker_pb2.WorkerInfo | None:
        """How the model runs, as the first worker that serves it reported; None before one has."""
        return next(iter(self.worker_infos()), None)

    def worker_infos(self) -> list[worker_pb2.WorkerInfo]:
        """What each worker that serves the model reported, in --workers order."""
        return [link.info for link in self.links if link.info is not None and link.serves_model]

    def limits(self) -> ModelLimits:
        """The model's limits, as its workers report them; Unavailable until one has been reached."""
        info = self.worker_info()
        if info is None:
            self.pick()  # raises Unavailable, saying why no worker is up
            raise Unavailable("no worker has reported the model's limits yet; retry")
        return ModelLimits(vocab_size=info.vocab_size, max_model_len=info.max_model_len)
