"""A thousand concurrent streaming calls against a small model: every one completes, no page leaks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from pagedserve.plumbing.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.client import generate_request
from tests.clients import internal_channel, wait_for_every_page
from tests.models import make_model
from tests.procs import start_stack

STREAMS = 1000
TOKENS = 8


async def one_thousand_streams(address: str) -> list[tuple[str, int, int]]:
    """(status, tokens streamed, completion tokens in usage) of each call."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> tuple[str, int, int]:
            request = generate_request(
                token_ids=[5 + i % 300, 7, 11], max_tokens=TOKENS, ignore_eos=True, seed=i
            )
            streamed, usage = 0, -1
            try:
                async for response in stub.Generate(request):
                    streamed += len(response.token_ids)
                    if response.HasField("usage"):
                        usage = response.usage.completion_tokens
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, streamed, usage
            return "OK", streamed, usage

        return await asyncio.gather(*(one(i) for i in range(STREAMS)))


def test_a_thousand_concurrent_streams(tmp_path: Path) -> None:
    model = make_model("llama", tmp_path / "model")
    # One client, on one connection: its share of admission, and of the connection's streams, is all of it
    # here (test_client_limits has the limits).
    flags = ("--kv-memory", "256MiB", "--max-num-seqs", "256", "--client-share", "1")
    flags += ("--max-concurrent-streams", str(STREAMS))
    stack = start_stack(tmp_path, "--model", str(model), *flags)
    try:
        start = time.monotonic()
        results = asyncio.run(one_thousand_streams(stack.address))
        seconds = time.monotonic() - start
        failed = [r for r in results if r != ("OK", TOKENS, TOKENS)]
        assert not failed, failed[:5]
        print(f"{STREAMS} concurrent streams, {STREAMS * TOKENS} tokens, in {seconds:.1f}s")
        with internal_channel(stack.worker_address()) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())
        assert (load.running, load.waiting, load.kv_pages_in_use) == (0, 0, 0)
        wait_for_every_page(stack.daemon_address)
    finally:
        assert stack.stop() == 0
