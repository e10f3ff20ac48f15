"""`pagedserve up` with several workers, and the frontend's routing, admission and failure answers."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.client import generate_request
from services.common.default_model import default_model_dir
from tests.models import make_model
from tests.procs import Stack, free_port, internal_channel, start_service, start_stack

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def two_workers() -> Iterator[Stack]:
    default_model_dir()
    run_dir = Path(tempfile.mkdtemp(prefix="ps-"))
    running = start_stack(run_dir, "--workers", "2", "--kv-memory", "256MiB")
    yield running
    assert running.stop() == 0, running.log()
    assert not running.survivors()
    shutil.rmtree(run_dir, ignore_errors=True)


def running_on(stack: Stack, index: int) -> int:
    with internal_channel(stack.worker_address(index)) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest()).running


def test_requests_spread_over_the_least_loaded_workers(two_workers: Stack) -> None:
    with grpc.insecure_channel(two_workers.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(generate_request(prompt=f"Essay {i}:", **LONG)) for i in range(6)]
        for call in calls:
            next(call)  # every request is running somewhere
        assert (running_on(two_workers, 0), running_on(two_workers, 1)) == (3, 3)
        for call in calls:
            call.cancel()


def start_frontend(run_dir: Path, *args: str) -> tuple[str, object]:
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "services.cli", "frontend", "--address", address, *args]
    return address, start_service(command, address, run_dir / f"frontend-{address.split(':')[1]}.log")


def test_no_worker_up_is_unavailable(tmp_path: Path) -> None:
    address, frontend = start_frontend(tmp_path, "--worker", f"unix:{tmp_path}/nobody.sock")
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            generation_pb2_grpc.GenerationStub(channel).Complete(generate_request("Hi"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker is up" in caught.value.details()
    finally:
        assert frontend.stop() == 0


def test_a_full_queue_is_refused_and_waiting_requests_go_by_priority(
    two_workers: Stack, tmp_path: Path
) -> None:
    worker = two_workers.worker_address(0)
    address, frontend = start_frontend(
        tmp_path, "--worker", worker, "--max-running", "1", "--max-waiting", "2"
    )
    finished: list[str] = []
    try:
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            holder = stub.Generate(generate_request(prompt="Hold the slot:", **LONG))
            next(holder)

            def run(name: str, priority: int) -> None:
                stub.Complete(generate_request(prompt=name, max_tokens=2, priority=priority))
                finished.append(name)

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                low = pool.submit(run, "low", 5)
                time.sleep(0.3)  # "low" queues first, "high" second
                high = pool.submit(run, "high", -1)
                time.sleep(0.3)
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Complete(generate_request(prompt="one too many", max_tokens=2))
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "the server is full: 1 requests running and 2 queued" in caught.value.details()
                holder.cancel()
                low.result(timeout=60)
                high.result(timeout=60)
        assert finished == ["high", "low"]
    finally:
        assert frontend.stop() == 0


def test_under_no_restart_a_dead_child_is_named_and_the_rest_are_stopped(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--kv-memory", "128MiB", "--no-restart")
    worker = next(line for line in stack.survivors() if "--name worker-0" in line)
    pid = int(worker.split()[0])
    os.kill(pid, signal.SIGKILL)
    assert stack.proc.wait(timeout=60) == 1
    assert "worker-0 killed by SIGKILL; stopping the rest" in stack.log()
    assert not stack.survivors()


def test_sigterm_drains_and_leaves_no_process(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--kv-memory", "128MiB")
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        result: list[pb.GenerateResponse] = []
        call = threading.Thread(
            target=lambda: result.append(stub.Complete(generate_request("Hi", max_tokens=8)))
        )
        call.start()
        time.sleep(0.2)
        assert stack.stop() == 0
        call.join(timeout=30)
    assert result and result[0].usage.completion_tokens > 0  # the request in flight was allowed to finish
    assert not stack.survivors()
    lines = stack.log().splitlines()
    order = [i for i, line in enumerate(lines) if "shutting down" in line]
    assert "stopping: the frontend drains first" in stack.log()
    assert [lines[i].split("|")[0].strip() for i in order] == ["frontend", "worker-0", "daemon"]


def test_a_random_qwen3_model_through_the_whole_stack(tmp_path: Path) -> None:
    model_dir = make_model("qwen3-qknorm", tmp_path / "model")
    stack = start_stack(tmp_path, "--model", str(model_dir), "--kv-memory", "64MiB")
    try:
        hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for length in (3, 40):
                prompt = list(range(5, 5 + length))
                reply = stub.Complete(
                    generate_request(token_ids=prompt, max_tokens=16, ignore_eos=True, temperature=0.0)
                )
                expected = hf.generate(
                    torch.tensor([prompt]), attention_mask=torch.ones(1, length, dtype=torch.long),
                    max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                )[0, length:].tolist()  # fmt: skip
                assert list(reply.token_ids) == expected
            chat = stub.Complete(
                generate_request(messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
            )
            assert chat.usage.completion_tokens >= 1
    finally:
        assert stack.stop() == 0
