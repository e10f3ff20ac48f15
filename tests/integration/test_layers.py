"""The structure, as running processes show it: every worker flag works through `pagedserve up`, the frontend
process never loads torch, and an unexpected error is INTERNAL, logged with its traceback."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.plumbing.rpc import start_server
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.models import make_model
from tests.procs import Stack, start_stack

FLAGS = ("--page-size", "8", "--kernels", "torch", "--dtype", "float32", "--no-prefix-caching")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("layers")
    model = make_model("llama", folder / "model")
    running = start_stack(folder, "--model", str(model), "--kv-memory", "64MiB", *FLAGS)
    yield running
    assert running.stop() == 0, running.log()
    shutil.rmtree(folder, ignore_errors=True)


def test_worker_flags_given_to_up_reach_the_workers(stack: Stack) -> None:
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.page_size, info.dtype, info.device) == (8, "float32", "cpu")
        prompt = list(range(3, 40))  # four full pages of 8 tokens
        first, second = (
            stub.Complete(generate_request(token_ids=prompt, max_tokens=2, temperature=0.0)) for _ in range(2)
        )
    # With the prefix cache off, the same prompt twice finds nothing cached.
    assert (first.usage.cached_prompt_tokens, second.usage.cached_prompt_tokens) == (0, 0)
    command = Path(f"/proc/{stack.pid('worker')}/cmdline").read_bytes().split(b"\0")
    assert all(flag.encode() in command for flag in FLAGS), command


def test_the_frontend_process_never_loads_torch(stack: Stack) -> None:
    assert "libtorch" not in Path(f"/proc/{stack.pid('frontend')}/maps").read_text()
    assert "libtorch" in Path(f"/proc/{stack.pid('worker')}/maps").read_text()  # the check sees it


class Faulty(generation_pb2_grpc.GenerationServicer):
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> None:
        if request.text == "bad":
            raise InvalidArgument("the text is bad")
        raise KeyError("a bug")  # no built-in exception is taken for the caller's fault


async def call_faulty(texts: list[str]) -> list[grpc.aio.AioRpcError]:
    """Tokenize each text on a real server of Faulty, over a real socket; the errors it answered."""
    running = await start_server(
        "127.0.0.1:0",
        lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(Faulty(), server),
        [],
    )
    errors = []
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for text in texts:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Tokenize(pb.TokenizeRequest(text=text))
                errors.append(caught.value)
    finally:
        await running.stop(grace_s=1)
    return errors


def test_a_bug_is_internal_and_logged_and_a_refusal_is_its_own_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR):
        bug, refusal = asyncio.run(call_faulty(["anything", "bad"]))
    assert bug.code() == grpc.StatusCode.INTERNAL
    assert bug.details() == "internal error (KeyError: 'a bug'); see the server's log"
    assert any(record.exc_info and record.exc_info[0] is KeyError for record in caplog.records)
    assert (refusal.code(), refusal.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "the text is bad")
