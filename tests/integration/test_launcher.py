"""`pagedserve up` with several workers, and the frontend's routing, admission and failure answers."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedserve.plumbing.rpc import wait_for_health
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.client import generate_request
from services.frontend.config import EVERY_WORKER_HEALTH
from services.launcher import PARENT_ENV
from services.worker.models import SUPPORTED
from tests.clients import Scrape, internal_channel
from tests.models import make_model
from tests.procs import Stack, free_port, launch_stack, module_stack, start_service, start_stack
from tests.waiting import wait_until

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def two_workers() -> Iterator[Stack]:
    limits = ("--max-running", "64", "--max-waiting", "512")
    with module_stack("--workers", "2", "--kv-memory", "256MiB", *limits) as running:
        yield running


def running_on(stack: Stack, index: int) -> int:
    with internal_channel(stack.worker_address(index)) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest()).running


def wait_for_running(stack: Stack, expected: set[tuple[int, int]]) -> tuple[int, int]:
    def counts() -> tuple[int, int]:
        return running_on(stack, 0), running_on(stack, 1)

    return wait_until(
        lambda: now if (now := counts()) in expected else None,
        30,
        lambda: f"the workers to run one of {expected}; they run {counts()}",
        interval_s=0.05,
    )


def test_requests_go_to_the_least_loaded_worker(two_workers: Stack) -> None:
    with grpc.insecure_channel(two_workers.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first, second = (stub.Generate(generate_request(prompt=f"Essay {i}:", **LONG)) for i in range(2))
        next(first), next(second)
        wait_for_running(two_workers, {(1, 1)})
        second.cancel()
        # Round-robin would send the third to the first's worker; the least-loaded one is the other.
        emptied = wait_for_running(two_workers, {(1, 0), (0, 1)})
        third = stub.Generate(generate_request(prompt="Essay 2:", **LONG))
        next(third)
        assert wait_for_running(two_workers, {(1, 1), (2, 0), (0, 2)}) == (1, 1), emptied
        calls = [stub.Generate(generate_request(prompt=f"Essay {i}:", **LONG)) for i in range(3, 7)]
        for call in calls:
            next(call)
        assert wait_for_running(two_workers, {(3, 3)}) == (3, 3)
        for call in (first, third, *calls):
            call.cancel()


def test_up_passes_the_admission_limits_to_the_frontend(two_workers: Stack) -> None:
    (frontend,) = [line for line in two_workers.survivors() if "services.cli frontend" in line]
    assert "--max-running 64" in frontend and "--max-waiting 512" in frontend


def start_frontend(run_dir: Path, *args: str) -> tuple[str, object]:
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "services.cli", "frontend", "--address", address, *args]
    return address, start_service(command, address, run_dir / f"frontend-{address.split(':')[1]}.log")


def test_no_worker_up_is_unavailable_and_says_why(two_workers: Stack, tmp_path: Path) -> None:
    nobody = f"unix:{tmp_path}/nobody.sock"
    wrong_secret = tmp_path / "secret"
    wrong_secret.write_text("not the stack's secret")
    address, frontend = start_frontend(
        tmp_path,
        "--worker",
        nobody,
        "--worker",
        two_workers.worker_address(0),
        "--secret-file",
        str(wrong_secret),
    )
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            generation_pb2_grpc.GenerationStub(channel).Complete(generate_request("Hi"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        details = caught.value.details()
        assert details.startswith(f"no worker is up ({nobody}: UNAVAILABLE: "), details
        assert (
            f"{two_workers.worker_address(0)}: UNAUTHENTICATED: this server needs the stack's shared"
            in details
        )
    finally:
        assert frontend.stop() == 0
    assert f"worker {two_workers.worker_address(0)} is not up: UNAUTHENTICATED" in frontend.log()


def test_the_frontend_says_whether_it_has_reached_every_worker(two_workers: Stack, tmp_path: Path) -> None:
    """Generation is SERVING once one worker is up, EVERY_WORKER_HEALTH (which `up` waits on) only once all
    are; a worker nothing listens for yet, as while `up` starts it, is no warning."""
    nobody = f"unix:{tmp_path}/nobody.sock"
    worker = two_workers.worker_address(0)
    address, frontend = start_frontend(tmp_path, "--worker", worker, "--worker", nobody)
    try:
        wait_for_health(address, 30, service="pagedserve.v1.Generation")
        with grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            reply = check(health_pb2.HealthCheckRequest(service=EVERY_WORKER_HEALTH), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        assert frontend.stop() == 0
    waiting = rf"INFO \S+ services\.frontend\.router: worker {nobody} is not up: UNAVAILABLE"
    assert re.search(waiting, frontend.log()), frontend.log()
    assert f"worker {worker} (worker-0) is up" in frontend.log()


def test_a_model_id_names_the_model_to_workers_and_clients_alike(tmp_path: Path) -> None:
    """`up --model-id` reaches the workers (their cached pages' namespace) and the frontend (the name it
    expects of its workers, and tells clients); a frontend of another name refuses the worker, saying why."""
    stack = start_stack(tmp_path, "--kv-memory", "128MiB", "--model-id", "house-model")
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).model_id == "house-model"
        *_, last = stub.Generate(generate_request("Hi", max_tokens=4, ignore_eos=True))
        assert last.usage.completion_tokens == 4
    with internal_channel(stack.worker_address(0)) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
    assert (info.model_id, info.kv_namespace) == ("house-model", "house-model@float32")
    address, frontend = start_frontend(tmp_path, "--worker", stack.worker_address(0))  # the folder's name
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            generation_pb2_grpc.GenerationStub(channel).Complete(generate_request("Hi"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"{stack.worker_address(0)}: it serves house-model, not SmolLM2-135M-Instruct-" in (
            caught.value.details()
        )
        assert "a frontend and its workers take one --model-id" in caught.value.details()
    finally:
        assert frontend.stop() == 0
    assert stack.stop() == 0


@pytest.mark.parametrize("command", ["daemon", "frontend", "up", "up --gateway"])
def test_a_taken_port_stops_the_start_saying_so(command: str, run_dir: Path) -> None:
    """Another process listens on the port (a second `pagedserve up` on the default one, say): the process
    says in one line that it cannot start and why, exits 1, and leaves nothing in its temporary folder; `up`
    says so before it starts any child, whether the port is the frontend's or the gateway's."""
    scratch = run_dir / "tmp"  # short: unix socket paths live in it
    scratch.mkdir()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args = {
            "daemon": ["daemon", "--address", f"127.0.0.1:{port}", "--shm-dir", str(run_dir)],
            "frontend": ["frontend", "--address", f"127.0.0.1:{port}"],
            "up": ["up", "--port", str(port), "--kv-memory", "64MiB"],
            "up --gateway": ["up", "--port", "0", "--gateway", str(port), "--kv-memory", "64MiB"],
        }[command]
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", *args],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "TMPDIR": str(scratch)},
        )
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    said = rf"cannot start: cannot listen on 127\.0\.0\.1:{port}: Address already in use$"  # the whole line
    assert re.search(said, log, re.MULTILINE), log
    assert "Traceback" not in log, log
    assert not list(scratch.iterdir())
    if command.startswith("up"):
        assert "daemon |" not in log, log  # no child started


def test_up_on_a_folder_that_is_no_model_stops_before_any_child(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--model", str(tmp_path / "none"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert (
        f"cannot start: {tmp_path / 'none'} is not a Hugging Face model folder: it has no config.json" in log
    )
    assert "daemon |" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("folder", ["missing", "broken tokenizer"])
def test_a_frontend_without_a_tokenizer_stops_saying_so(folder: str, tmp_path: Path) -> None:
    """A model folder that is not there, or whose tokenizer.json does not parse: one line, no traceback."""
    model = tmp_path / "model"
    if folder == "broken tokenizer":
        make_model("llama", model)
        (model / "tokenizer.json").write_text("{x")
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "frontend", "--model", str(model), "--address", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1, done.stderr
    reason = "it has no config.json" if folder == "missing" else "Expecting property name"
    assert re.search(rf"cannot start: no tokenizer from {model}: .*{reason}", done.stderr), done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_full_queue_is_refused_and_waiting_requests_go_by_priority(
    two_workers: Stack, tmp_path: Path
) -> None:
    worker = two_workers.worker_address(0)
    metrics = free_port()
    limits = (
        "--max-running",
        "1",
        "--max-waiting",
        "2",
        "--client-share",
        "1",
        "--metrics-port",
        str(metrics),
    )
    address, frontend = start_frontend(tmp_path, "--worker", worker, *limits)

    def waiting() -> float:
        return Scrape(f"http://127.0.0.1:{metrics}/metrics")("pagedserve_requests_waiting")

    def queued(count: int) -> None:
        """Wait until `count` requests wait for the one admission slot, as the frontend counts them."""
        wait_until(lambda: waiting() == count, 30, lambda: f"{count} queued requests; {waiting():g} wait")

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
                queued(1)  # "low" queues first, "high" second
                high = pool.submit(run, "high", 0)
                queued(2)
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
    """The request in flight finishes; a client watching the frontend's health (gRPC's client-side health
    checking) is told NOT_SERVING, then its watch ends saying why: it used to hold the stop for all of its
    10 s of grace, then see "Cancelling all calls"."""
    stack = start_stack(tmp_path, "--kv-memory", "128MiB")
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        call = stub.Generate(generate_request("Hi", max_tokens=24, ignore_eos=True))
        responses = [next(call)]  # in flight when the stack is told to stop
        stopping = concurrent.futures.ThreadPoolExecutor(1).submit(stack.stop)
        responses += list(call)
        with pytest.raises(grpc.RpcError) as ended:
            assert {reply.status for reply in watch} == {health_pb2.HealthCheckResponse.NOT_SERVING}
        assert (ended.value.code(), ended.value.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "the server is shutting down",
        )
        assert stopping.result(timeout=60) == 0
    # The request in flight was allowed to finish.
    last = responses[-1]
    assert last.finish_reason == pb.GenerateResponse.LENGTH and last.usage.completion_tokens == 24
    assert not stack.survivors()
    lines = stack.log().splitlines()
    order = [i for i, line in enumerate(lines) if "server: shutting down" in line]
    assert "stopping: the frontend drains first" in stack.log()
    assert [lines[i].split("|")[0].strip() for i in order] == ["frontend", "worker-0", "daemon"]


def test_a_killed_launcher_takes_its_children_with_it(tmp_path: Path) -> None:
    """Each child asks for SIGTERM on its launcher's death as it starts (spawn): a SIGKILL to `up` orphans
    none."""
    stack = start_stack(tmp_path, "--kv-memory", "128MiB")
    assert len(stack.survivors()) == 4  # up, the daemon, a worker and the frontend
    stack.proc.kill()
    stack.proc.wait(timeout=10)
    wait_until(lambda: not stack.survivors(), 60, lambda: f"the children to exit: {stack.survivors()}")


def test_a_process_spawned_by_one_already_gone_exits() -> None:
    """The parent may die before its child asks the kernel for the signal: the child sees it and goes."""
    child = subprocess.Popen(
        [sys.executable, "-c", "from services.cli import main; import time; main(['--help'])"],
        env={**os.environ, PARENT_ENV: "1"},  # not its parent: the spawner has gone
        stdout=subprocess.DEVNULL,
    )
    assert child.wait(timeout=30) == -signal.SIGTERM


# A process whose gRPC channels have just closed (its grpc_shutdown thread running), and then starts a child:
# with a preexec_fn, subprocess forks and gRPC's fork handlers deadlock (grpc/grpc#31885), 300 rounds of
# this hung every time in a scratch run; spawn does not fork.
SPAWN_AFTER_CHANNELS = """
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from services.launcher import spawn
for _ in range(300):
    with grpc.insecure_channel(sys.argv[1]) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert spawn([sys.executable, "-c", ""], {}).wait() == 0
print("spawned 300")
"""


def test_spawning_right_after_grpc_channels_close_does_not_hang() -> None:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done = subprocess.run(
            [sys.executable, "-c", SPAWN_AFTER_CHANNELS, f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).parents[2],
        )
    finally:
        server.stop(None)
    assert done.returncode == 0 and "spawned 300" in done.stdout, done.stderr[-2000:]


def test_sigterm_while_starting_stops_the_stack_at_once(tmp_path: Path) -> None:
    stack = launch_stack(tmp_path, "--kv-memory", "128MiB")

    def loading_or_exited() -> str | None:
        if "worker-0 |" in stack.log():  # the worker is loading: the stack is not up yet
            return "loading"
        return "exited" if stack.proc.poll() is not None else None

    state = wait_until(loading_or_exited, 120, lambda: f"worker-0 to start:\n{stack.log()}", interval_s=0.05)
    assert state == "loading", stack.log()
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=20) == 0, stack.log()
    # The worker may have come up meanwhile: then the frontend was the one starting.
    assert re.search(r"stopped while (worker-0|frontend) was starting", stack.log()), stack.log()
    assert "pagedserve is up" not in stack.log() and not stack.survivors()


def test_workers_and_frontend_start_together_and_one_that_dies_stops_the_start(tmp_path: Path) -> None:
    """The workers need only the daemon, and the frontend reaches them as they come up: one after another,
    their start times added up."""
    stack = launch_stack(tmp_path, "--workers", "2", "--kv-memory", "128MiB")

    def started(sign: str) -> int | None:
        return next((int(line.split()[0]) for line in stack.survivors() if sign in line), None)

    def both_started() -> int | None:
        second, frontend = started("--name worker-1 "), started("services.cli frontend ")
        return second if second is not None and frontend is not None else None

    second = wait_until(both_started, 120, lambda: f"worker-1 and the frontend to start:\n{stack.log()}")
    assert started("--name worker-0 ") is not None
    assert not (stack.run_dir / "worker-0.sock").exists(), "the others started only once worker-0 served"
    os.kill(second, signal.SIGKILL)
    assert stack.proc.wait(timeout=60) == 1, stack.log()
    assert "worker-1 killed by SIGKILL; stopping the rest" in stack.log()
    assert "pagedserve is up" not in stack.log() and not stack.survivors()


def test_up_is_up_once_the_frontend_has_reached_every_worker(tmp_path: Path) -> None:
    """The frontend starts beside the workers and retries each until it answers, up to a second apart; had
    `up` taken the frontend's first worker for all, the first requests would all go to that one."""
    stack = start_stack(tmp_path, "--workers", "2", "--kv-memory", "128MiB")
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(generate_request(prompt=f"Essay {i}:", **LONG)) for i in range(2)]
        for call in calls:
            next(call)
        assert wait_for_running(stack, {(1, 1), (2, 0), (0, 2)}) == (1, 1), stack.log()
        for call in calls:
            call.cancel()
    assert stack.stop() == 0, stack.log()


@pytest.mark.parametrize("family", ["qwen3-qknorm", "qwen3-moe", "gemma2-softcap"])
def test_a_random_model_of_a_family_through_the_whole_stack(family: str, tmp_path: Path) -> None:
    """Qwen3, Qwen3-MoE (a layer of experts, then a dense one) and Gemma 2 (a sliding window of 24, then a
    full layer; softcaps), token for token as transformers, prompts shorter and longer than the window."""
    model_dir = make_model(family, tmp_path / "model")
    stack = start_stack(tmp_path, "--model", str(model_dir), "--kv-memory", "64MiB")
    try:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
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


def test_a_model_of_an_unsupported_family_is_refused_at_load_naming_the_supported(tmp_path: Path) -> None:
    model_dir = make_model("llama", tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "cohere"}))
    stack = launch_stack(tmp_path, "--model", str(model_dir), "--kv-memory", "64MiB", "--no-restart")
    assert stack.proc.wait(timeout=120) == 1, stack.log()
    assert f"model_type 'cohere' is not supported; pagedserve runs {', '.join(SUPPORTED)}" in stack.log()
    assert "pagedserve is up" not in stack.log() and not stack.survivors()


def test_a_checkpoint_holding_a_nan_is_refused_at_load_naming_the_tensor(tmp_path: Path) -> None:
    """It used to load, report SERVING, and stream tokens of no meaning with NaN logprobs."""
    model_dir = make_model("llama", tmp_path / "model")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    stack = launch_stack(tmp_path, "--model", str(model_dir), "--kv-memory", "64MiB", "--no-restart")
    assert stack.proc.wait(timeout=120) == 1, stack.log()
    assert "model.layers.1.mlp.up_proj.weight holds NaN or infinite values in" in stack.log()
    assert "Traceback" not in stack.log() and not stack.survivors()
