"""`vllm.grpc.engine.VllmEngine`, SMG's vLLM worker protocol, served beside pagedserve.v1.Generation.

A thin servicer over the same path as pagedserve's own Generate: each request is converted at the edge
(`vllm_request`), runs in the same `call.Call` (admission, the least-loaded worker, stop strings), and its
responses go back as vLLM's chunks and completes, token ids only: the gateway detokenizes, so a request
decodes text only to find its stop strings, if it has any. A stream sends a chunk per engine step that
produced tokens and a complete per sample when it ends; a non-streamed request sends one complete per sample
with everything. When the call ends early (the client goes away, or `Abort` names the request) every sample
is aborted in its worker, which frees its pages within one step. The node's cached pages are the daemon's
to tell (`node_cache`).

Two instances serve it: one on the public port, and one on the gateway's own listener (--gateway-address).
The node's control surface reaches beyond a caller's own requests: `SubscribeKvEvents` tells the token ids
of every client's cached prompts, `FlushCache` drops them, and `Abort` ends requests by id, whoever sent
them. Only the gateway's instance serves those; the public one refuses them to every client with
PERMISSION_DENIED, and keeps no table of request ids for anyone to probe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from pagedserve.plumbing.errors import InvalidArgument, PermissionDenied, StatusError, Unimplemented
from services.frontend import vllm_info, vllm_request
from services.frontend.call import Call, CallFrame
from services.frontend.generation import RequestPipeline
from services.frontend.node_cache import NodeCache
from services.frontend.validation import request_id_of
from services.frontend.vllm_answer import SampleAnswer

# What each RPC of the control surface does beyond the caller's own requests, as a refusal names it.
_CONTROL = {
    "SubscribeKvEvents": "it tells the token ids of every client's cached prompts",
    "FlushCache": "it drops every client's cached pages",
    "Abort": "it ends requests by id, whoever sent them (end your own by closing its Generate stream)",
}


class VllmEngineService(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(
        self,
        pipeline: RequestPipeline,
        facts: vllm_info.ModelFacts,
        node_cache: NodeCache | None,
        drain_timeout_s: float,
        *,
        gateway: bool,
    ) -> None:
        """gateway: this instance serves the gateway's own listener, the only one with the control surface."""
        self._pipeline = pipeline
        self._facts = facts
        self._node_cache = node_cache
        self._calls = CallFrame(pipeline, drain_timeout_s, with_text=False)
        self._gateway = gateway
        self._running: dict[str, Call] = {}  # by request id, for Abort: the gateway's only
        self._last_request = 0.0

    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            await self._generate(request, context)
        except StatusError as refusal:  # checked as pagedserve's own request: name the fields sent
            raise vllm_request.in_vllm_terms(refusal) from None

    async def _generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self._last_request = time.time()
        request_id = request_id_of(request.request_id)
        if self._gateway and request_id in self._running:
            raise InvalidArgument(f"request {request_id!r} is already running; give each request its own id")
        converted = vllm_request.request_of(request)
        # The gateway's requests are many users' (it limits them itself), a public caller's its own.
        client = None if self._gateway else self._pipeline.clients.of(context)
        with self._calls.open(converted, request_id, context, client) as call:
            if self._gateway:
                self._running[request_id] = call
            answers = [SampleAnswer(sample, request.stream) for sample in call.samples]
            try:
                async for response in call.responses():
                    for message in answers[response.index].messages(response):
                        await call.deliver(message)
            finally:
                self._running.pop(request_id, None)

    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        self._check_gateway("Abort")
        for request_id in request.request_ids:  # an id that has ended, or never ran, is no error
            if (call := self._running.get(request_id)) is not None:
                call.cancel()
        return vllm_engine_pb2.AbortResponse()

    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        router = self._pipeline.router
        if router.any_up:
            return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="serving")
        why = "; ".join(f"{link.address}: {link.refusing or link.down_reason}" for link in router.links)
        return vllm_engine_pb2.HealthCheckResponse(
            healthy=False, message=f"no worker accepts requests ({why})"
        )

    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        return self._facts.model_info(self._pipeline.router)

    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        admission = self._pipeline.admission
        active = admission.running + admission.waiting
        router = self._pipeline.router
        return self._facts.server_info(router, active, self._last_request, admission.max_running)

    async def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        admission = self._pipeline.admission
        return vllm_info.loads(
            self._pipeline.router, admission.running, admission.waiting, admission.max_running
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        for chunk in await asyncio.to_thread(lambda: list(self._facts.tokenizer_chunks())):
            yield chunk

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        pages = await self._cache("FlushCache").flush()
        return common_pb2.FlushCacheResponse(
            success=True, message=f"dropped {pages} cached pages that no request was using"
        )

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        async for batch in self._cache("SubscribeKvEvents").events(request.start_sequence_number):
            yield batch

    async def Embed(
        self, request: vllm_engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.EmbedResponse:
        raise Unimplemented("pagedserve serves generation only: no embeddings")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        raise Unimplemented("pagedserve has no profiler to start; profile a worker with py-spy")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        raise Unimplemented("pagedserve has no profiler to stop")

    def end_event_streams(self) -> None:
        """At shutdown: end SubscribeKvEvents' streams, which never end on their own."""
        if self._node_cache is not None:
            self._node_cache.end_watches()

    def _check_gateway(self, rpc: str) -> None:
        if not self._gateway:
            raise PermissionDenied(
                f"{rpc} is the gateway's alone, since {_CONTROL[rpc]}: this port refuses it to every "
                "client; a gateway reaches it on the frontend's --gateway-address (pagedserve up --gateway "
                "wires SMG there)"
            )

    def _cache(self, rpc: str) -> NodeCache:
        self._check_gateway(rpc)
        if self._node_cache is None:
            raise Unimplemented(f"{rpc} needs the node's memory daemon: start the frontend with --daemon")
        return self._node_cache
