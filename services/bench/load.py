"""Sending a workload to a running server and timing every token.

Under a fixed concurrency, that many requests are in flight at all times; under a rate, each request leaves
at its Poisson arrival time whatever is still running. `drive` does the pacing for any server; `grpc_target`
sends each request to pagedserve's Generate, greedy, streaming (`openai` does the same over HTTP).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from tqdm import tqdm

from pagedserve.plumbing.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.bench.results import RequestRecord
from services.bench.workloads import BenchRequest

Send = Callable[[BenchRequest], Awaitable[RequestRecord]]


async def drive(
    requests: list[BenchRequest], send: Send, *, concurrency: int | None, label: str
) -> list[RequestRecord]:
    """Send every request; with a concurrency, keep that many in flight; else follow their arrival times.
    A session's turns go one after another, each once the one before has finished."""
    progress = tqdm(total=len(requests), desc=label, unit="req", leave=False)
    slots = asyncio.Semaphore(concurrency or len(requests))
    start = time.perf_counter()
    chains: dict[object, list[BenchRequest]] = {}
    for request in requests:
        key = ("session", request.session) if request.session is not None else ("request", request.index)
        chains.setdefault(key, []).append(request)

    async def paced(chain: list[BenchRequest]) -> list[RequestRecord]:
        delay = start + chain[0].arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        records = []
        for request in chain:
            async with slots:
                records.append(await send(request))
            progress.update()
        return records

    done = await asyncio.gather(*(paced(chain) for chain in chains.values()))
    progress.close()
    return sorted((record for records in done for record in records), key=lambda record: record.index)


@asynccontextmanager
async def grpc_target(
    address: str,
    credentials: grpc.ChannelCredentials | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> AsyncIterator[Send]:
    """A sender to pagedserve's frontend at address, over one channel."""
    async with _channel(address, credentials) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def send(request: BenchRequest) -> RequestRecord:
            return await _one(stub, request, metadata)

        yield send


async def flush_prefix_cache(gateway_listener: str) -> str:
    """Empty the prefix cache of a pagedserve node (SMG's FlushCache, which only the frontend's gateway
    listener serves: plain gRPC, no token), so that a run does not find an earlier run's prompts there;
    returns what the node said."""
    async with _channel(gateway_listener, None) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        try:
            reply = await stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            return f"not flushed ({exc.code().name}: {exc.details()})"
    return reply.message


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


async def _one(
    stub: generation_pb2_grpc.GenerationStub, request: BenchRequest, metadata: tuple[tuple[str, str], ...]
) -> RequestRecord:
    record = RequestRecord(request.index, len(request.prompt_ids), sent=time.perf_counter())
    sampling = generation_pb2.SamplingParams(
        max_tokens=request.max_tokens, temperature=0.0, ignore_eos=request.ignore_eos
    )
    message = generation_pb2.GenerateRequest(prompt_token_ids=request.prompt_ids, sampling=sampling)
    try:
        async for response in stub.Generate(message, metadata=metadata):
            now = time.perf_counter()
            record.token_times += [now] * len(response.token_ids)
            if response.HasField("usage"):
                record.cached_prompt_tokens = response.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        record.status = exc.code().name
    record.done = time.perf_counter()
    return record
