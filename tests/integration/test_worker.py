"""The compute worker as a real process on the default model, attached to a real daemon, over gRPC."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.kernels.cpu_features import cpu_features
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.default_model import default_model_dir
from services.common.sampling import SamplingOptions
from tests.clients import internal_channel, pool_counts, wait_for_every_page
from tests.integration.worker_stream import WorkerStream, submit_of, tokens
from tests.procs import DaemonProcess, ServiceProcess, run_local_worker, start_daemon, start_worker
from tests.waiting import wait_until

Reason = generation_pb2.GenerateResponse.FinishReason


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()  # converted once per machine, before any worker needs it


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[tuple[DaemonProcess, ServiceProcess]]:
    run_dir = Path(tempfile.mkdtemp(prefix="ps-"))
    daemon = start_daemon(run_dir)
    worker = start_worker(run_dir, daemon.address, "--kv-memory", "256MiB", "--max-batched-tokens", "64")
    yield daemon, worker
    assert worker.stop() == 0, worker.log()
    assert daemon.stop() == 0, daemon.log()
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def stream(stack: tuple[DaemonProcess, ServiceProcess]) -> Iterator[WorkerStream]:
    connection = WorkerStream(stack[1].address)
    yield connection
    connection.close()


def chat(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def wait_until_idle(stub: worker_pb2_grpc.WorkerStub, timeout_s: float = 10.0) -> None:
    """Poll the worker until no request runs and no page is in use."""

    def load() -> worker_pb2.Load:
        return stub.GetLoad(worker_pb2.GetLoadRequest())

    wait_until(
        lambda: not ((now := load()).running or now.kv_pages_in_use),
        timeout_s,
        lambda: f"the worker to be idle; it is still busy: {load()}",
    )


def test_greedy_tokens_and_logprobs_match_transformers(
    stream: WorkerStream, model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = {
        "short": chat(tokenizer, "Hi!"),
        "france": chat(tokenizer, "What is the capital of France?"),
        "long": chat(tokenizer, "Write a haiku about the sea. " * 6),  # over the 64-token budget: chunked
    }
    options = SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    for request_id, prompt in prompts.items():
        stream.submit(request_id, prompt, options)
    outputs = stream.collect(set(prompts))

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for request_id, prompt in prompts.items():
        expected = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        generated = tokens(outputs[request_id])
        assert generated == expected.sequences[0, len(prompt) :].tolist(), request_id
        reference = torch.log_softmax(torch.cat(expected.logits).float(), dim=-1)
        logprobs = [lp for output in outputs[request_id] for lp in output.logprobs]
        assert len(logprobs) == len(generated) == 24, f"{request_id}: {len(logprobs)} logprobs"
        for step, (lp, token) in enumerate(zip(logprobs, generated, strict=True)):
            assert lp.token_id == token
            assert abs(lp.logprob - reference[step, token].item()) < 1e-3
            assert [top.token_id for top in lp.top] == reference[step].topk(3).indices.tolist()
        last = outputs[request_id][-1]
        assert (last.finish_reason, last.prompt_tokens) == (Reason.LENGTH, len(prompt))


def test_abort_and_a_dropped_stream_return_every_page(
    stack: tuple[DaemonProcess, ServiceProcess], stream: WorkerStream, tokenizer: PreTrainedTokenizerBase
) -> None:
    daemon, worker = stack
    long_run = SamplingOptions(max_tokens=2000, temperature=0.0, ignore_eos=True)
    stream.submit("endless", chat(tokenizer, "Count to a thousand."), long_run)
    while not any(output.token_ids for output in stream.next_outputs()):
        pass
    stream.abort("endless")
    finished = stream.collect({"endless"})["endless"][-1]
    assert finished.finish_reason == Reason.ABORT
    load = stream.stub.GetLoad(worker_pb2.GetLoadRequest())
    assert (load.running, load.kv_pages_in_use) == (0, 0)

    dropped = WorkerStream(worker.address)
    dropped.submit("orphan", chat(tokenizer, "Count to a thousand."), long_run)
    while not any(output.token_ids for output in dropped.next_outputs()):
        pass
    dropped.close()  # the frontend goes away mid-stream
    wait_until_idle(stream.stub)
    wait_for_every_page(daemon.address)


def test_bad_submits_get_errors_and_the_worker_keeps_serving(
    stream: WorkerStream, tokenizer: PreTrainedTokenizerBase
) -> None:
    good = SamplingOptions(max_tokens=4, temperature=0.0)
    bad_sampling = generation_pb2.SamplingParams(
        max_tokens=4, temperature=-1.0, top_p=1.0, repetition_penalty=1.0
    )
    cases = {
        "too-long": ([5] * 9000, good, "the prompt has 9000 tokens, but the model's context is 8192"),
        # Within the context, but past the pool's 256 MiB: (7000 + 1) / 16 pages.
        "too-big-for-the-pool": ([5] * 7000, good, "the prompt needs 438 KV pages, more than the pool's"),
        "bad-token": (
            [5, 49152],
            good,
            "prompt_token_ids holds 49152, which is not a token of this model (0..49151)",
        ),
        "empty": ([], good, "the prompt is empty"),
        "bad-temperature": (
            [5, 6],
            bad_sampling,
            "sampling.temperature must be between 0.0 and 100.0, got -1.0",
        ),
    }
    for request_id, (prompt, options, _) in cases.items():
        stream.submit(request_id, prompt, options)
    outputs = stream.collect(set(cases))
    for request_id, (_, _, message) in cases.items():
        (output,) = outputs[request_id]
        assert output.finish_reason == Reason.ABORT and message in output.error, output.error
        # A prompt over the context or past the pool: no retry helps, but a shorter prompt or more memory can.
        exhausted = request_id in ("too-long", "too-big-for-the-pool")
        expected = grpc.StatusCode.RESOURCE_EXHAUSTED if exhausted else grpc.StatusCode.INVALID_ARGUMENT
        assert output.error_code == expected.value[0], output
    # Pins: a TTL needs a tenant and at most a day; a worker started without prefix caching cannot pin.
    pins = {
        "pin-without-tenant": (dict(cache_ttl_seconds=60), "a pin's tenant must be 1 to 256 bytes, got 0"),
        "pin-too-long": (dict(cache_ttl_seconds=86401, tenant="t"), "cache_ttl_seconds is 86401"),
    }
    for request_id, (fields, _) in pins.items():
        submit = submit_of(request_id, [5, 6], good)
        submit.MergeFrom(worker_pb2.Submit(**fields))
        stream.send(worker_pb2.WorkerRequest(submit=[submit]))
    outputs = stream.collect(set(pins))
    for request_id, (_, message) in pins.items():
        (output,) = outputs[request_id]
        assert message in output.error and output.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    stream.submit("fine", chat(tokenizer, "Hi"), good)
    assert len(tokens(stream.collect({"fine"})["fine"])) == 4


def test_a_duplicate_request_id_ends_the_stream(
    stack: tuple[DaemonProcess, ServiceProcess], tokenizer: PreTrainedTokenizerBase
) -> None:
    connection = WorkerStream(stack[1].address)
    endless = SamplingOptions(max_tokens=2000, temperature=0.0, ignore_eos=True)
    connection.submit("twin", chat(tokenizer, "Hi"), endless)
    connection.submit("twin", chat(tokenizer, "Hi"), endless)
    with pytest.raises(grpc.RpcError) as caught:
        connection.collect({"twin"})
    connection.close()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request id 'twin' is already running on this stream" in caught.value.details()
    with internal_channel(stack[1].address) as channel:
        wait_until_idle(worker_pb2_grpc.WorkerStub(channel))  # the first "twin" ended with its stream


def test_health_info_and_load(stack: tuple[DaemonProcess, ServiceProcess], stream: WorkerStream) -> None:
    health = health_pb2_grpc.HealthStub(stream.channel)
    for service in ("", "pagedserve.worker.v1.Worker"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = stream.stub.GetInfo(worker_pb2.GetInfoRequest())
    assert info.model_id.startswith("SmolLM2-135M-Instruct-")
    assert (info.max_model_len, info.vocab_size, list(info.eos_token_ids)) == (8192, 49152, [2])
    assert (info.dtype, info.device, info.page_size) == ("float32", "cpu", 16)
    assert info.kv_namespace == f"{info.model_id}@float32"
    load = stream.stub.GetLoad(worker_pb2.GetLoadRequest())
    assert load.kv_pages_total == pool_counts(stack[0].address).total_pages


def test_the_prefix_cache_outlives_a_worker_restart(
    run_dir: Path, daemon: DaemonProcess, model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompt = chat(tokenizer, "Tell me about the history of Paris. " * 8)
    options = SamplingOptions(max_tokens=8, temperature=0.0)
    first = start_worker(run_dir, daemon.address, "--kv-memory", "128MiB", name="first")
    connection = WorkerStream(first.address)
    connection.submit("p", prompt, options)
    before = connection.collect({"p"})["p"]
    connection.close()
    first.kill()  # SIGKILL: no goodbye to the daemon
    assert before[-1].cached_prompt_tokens == 0

    second = start_worker(run_dir, daemon.address, "--kv-memory", "128MiB", name="second")
    connection = WorkerStream(second.address)
    connection.submit("p", prompt, options)
    after = connection.collect({"p"})["p"]
    connection.close()
    assert second.stop() == 0
    assert after[-1].cached_prompt_tokens == (len(prompt) - 1) // 16 * 16
    assert tokens(after) == tokens(before)


def test_a_worker_reuses_only_the_pages_its_own_precision_computed(
    run_dir: Path, daemon: DaemonProcess, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Workers of one model at different precisions on one daemon: a bfloat16 model's keys and values differ
    from those of a float32 model that keeps them in a bfloat16 pool (the same pool), those from a float32
    model's kept whole, and an int8 model's from a float32 model's. Each finds in the prefix cache only what
    a worker of its own precision left."""
    prompt = chat(tokenizer, "Describe the rivers and the bridges of Paris. " * 6)
    options = SamplingOptions(max_tokens=4, temperature=0.0)
    full_pages = (len(prompt) - 1) // 16 * 16
    # --quantization int8 rounds the activations too where vpdpbusd runs (the C++ kernels, auto's on a CPU);
    # elsewhere they stay float32.
    int8 = "float32-w8a8" if cpu_features().avx512_vnni.usable else "float32-w8a32"
    runs = [  # name, flags, the precision its pages are cached under, the prompt tokens it finds cached
        ("bf16", ("--dtype", "bfloat16"), "bfloat16", 0),
        ("fp32-bf16-pool", ("--dtype", "float32", "--kv-cache-dtype", "bfloat16"), "float32-kv-bfloat16", 0),
        ("bf16-again", ("--dtype", "bfloat16"), "bfloat16", full_pages),
        ("fp32", ("--dtype", "float32"), "float32", 0),
        ("int8", ("--dtype", "float32", "--quantization", "int8"), int8, 0),
        ("int8-again", ("--dtype", "float32", "--quantization", "int8"), int8, full_pages),
    ]
    for name, flags, precision, cached in runs:
        worker = start_worker(run_dir, daemon.address, "--kv-memory", "64MiB", *flags, name=name)
        connection = WorkerStream(worker.address)
        info = connection.stub.GetInfo(worker_pb2.GetInfoRequest())
        connection.submit("p", prompt, options)
        outputs = connection.collect({"p"})["p"]
        connection.close()
        assert worker.stop() == 0, worker.log()
        assert outputs[-1].cached_prompt_tokens == cached, (name, info.kv_namespace)
        assert info.kv_namespace == f"{info.model_id}@{precision}", (name, info.kv_namespace)
    with internal_channel(daemon.address) as channel:
        stats = memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(memory_pb2.GetStatsRequest())
    namespaces = {publisher.model_id.split("@")[1] for pool in stats.pools for publisher in pool.publishers}
    assert {"bfloat16", "float32-kv-bfloat16", "float32"} < namespaces and len(namespaces) == 4, namespaces


@pytest.mark.parametrize(("memory", "pages"), [("1TiB", 1491308), ("1", 0)])
def test_an_in_process_pool_too_large_for_the_machine_or_of_no_page_is_refused(
    tmp_path: Path, memory: str, pages: int
) -> None:
    """Without a daemon the worker sizes its pool itself: 1 TiB once grew its page books to 15 GB of memory
    before the pool's allocation failed, with a traceback; now one line says why, before anything is made."""
    done = run_local_worker(
        *("--kv-memory", memory, "--kernels", "torch", "--dtype", "float32"),
        *("--address", f"unix:{tmp_path}/w.sock"),
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"makes {pages} pages of 720.00 KiB: an in-process pool takes 2 pages or more" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_context_past_the_models_positions_is_refused(tmp_path: Path) -> None:
    """--max-model-len may shorten the model's context, not stretch it past what it was trained on."""
    done = run_local_worker(
        *("--max-model-len", "8193", "--kernels", "torch", "--dtype", "float32"),
        *("--address", f"unix:{tmp_path}/w.sock"),
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--max-model-len 8193 is above" in done.stderr
    assert "max_position_embeddings (8192): the model was not trained on positions past it" in done.stderr
    assert "Traceback" not in done.stderr
