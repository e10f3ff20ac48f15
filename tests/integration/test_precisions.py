"""A whole stack on the default model in each precision the worker serves on a CPU: `--dtype bfloat16` (a
bfloat16 pool in the daemon), `--quantization int8`, a float32 model over a bfloat16 pool
(`--kv-cache-dtype bfloat16`), and `--dtype auto`, whose worker says what it picked and why (and, for int8
weights, whether the activations are rounded to int8 for vpdpbusd). Each stack's greedy tokens are those of
the same model run in this process through the engine, so the flags reach the worker's model and pool; a
precision that does not exist is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from memory_daemon.shape import DType
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops
from pagedserve.kernels.cpu_features import cpu_features
from services.client import Client
from services.common.default_model import default_model_dir
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineCore
from services.worker.core.engine_config import EngineConfig
from services.worker.kv.local import LocalKVCache
from services.worker.models import load_model
from services.worker.quantization import Quantization
from tests.procs import start_stack

PROMPT = "What is the capital of France?"
TOKENS = 24


def in_process(
    dtype: torch.dtype,
    quantization: Quantization,
    prompt: list[int],
    kv_dtype: DType,
    config: EngineConfig = EngineConfig(),  # noqa: B008 - frozen
) -> list[int]:
    ops = cpu_ops()
    assert ops is not None
    model = load_model(
        default_model_dir(),
        dtype=dtype,
        device=torch.device("cpu"),
        backend=CpuBackend(ops, cpu_features()),
        quantization=quantization,
    )
    kv = LocalKVCache(model.spec.pool_shape(kv_dtype, 16), 64)
    engine = EngineCore(model, kv, config)
    engine.add(
        engine.new_sequence(
            0, EngineRequest(tuple(prompt), SamplingOptions(max_tokens=TOKENS, temperature=0.0))
        )
    )
    return [token for output in engine.run_until_done() for token in output.token_ids]


@pytest.mark.parametrize(
    ("flags", "dtype", "quantization", "kv_dtype", "says"),
    [
        (("--dtype", "bfloat16"), torch.bfloat16, "none", "bfloat16", "dtype: bfloat16, as --dtype says"),
        (("--quantization", "int8"), torch.float32, "int8", "float32", "float32, int8 linear layers"),
        (
            ("--dtype", "bfloat16", "--quantization", "int8"),
            torch.bfloat16,
            "int8",
            "bfloat16",
            "bfloat16, int8 linear layers",
        ),
        (
            ("--dtype", "float32", "--kv-cache-dtype", "bfloat16"),
            torch.float32,
            "none",
            "bfloat16",
            "pages in bfloat16 from the daemon",
        ),
    ],
    ids=["bfloat16", "int8", "int8-bfloat16", "float32-kv-bfloat16"],
)
def test_a_stack_serves_the_precision_asked_for(
    run_dir: Path,
    flags: tuple[str, ...],
    dtype: torch.dtype,
    quantization: Quantization,
    kv_dtype: DType,
    says: str,
) -> None:
    stack = start_stack(run_dir, *flags, "--kv-memory", "64MiB")
    try:
        with Client(stack.address, timeout_s=120) as client:
            info = client.model_info()
            assert info.dtype == str(dtype).removeprefix("torch.")
            prompt = client.tokenize(PROMPT)
            served = [
                t
                for r in client.stream(token_ids=prompt, max_tokens=TOKENS, temperature=0.0)
                for t in r.token_ids
            ]
        with grpc.insecure_channel(stack.address) as channel:
            server = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetServerInfo(
                vllm_engine_pb2.GetServerInfoRequest()
            )
    finally:
        assert stack.stop() == 0, stack.log()
    # vLLM's meaning: auto is the model's dtype, anything else a pool of its own.
    asked = flags[flags.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in flags else "auto"
    assert server.kv_cache_dtype == asked
    assert says in stack.log()
    assert f"{kv_dtype}, 16 tokens a page" in stack.log()  # the daemon's pool
    found = cpu_features()
    # W8A8 where vpdpbusd runs (for bfloat16 outputs, where vcvtneps2bf16 runs too)
    int8_x = found.avx512_vnni.usable and (dtype == torch.float32 or found.avx512_bf16.usable)
    assert ("times activations rounded to int8 a row" in stack.log()) == (quantization == "int8" and int8_x)
    assert served == in_process(dtype, quantization, prompt, kv_dtype)


@pytest.mark.parametrize(
    ("flags", "quantization"),
    [(("--dtype", "auto"), "none"), (("--dtype", "float32", "--quantization", "int8"), "int8")],
    ids=["auto", "float32-int8"],
)
def test_a_prompt_longer_than_a_step_is_served(
    run_dir: Path, flags: tuple[str, ...], quantization: Quantization
) -> None:
    """A prompt of several --max-batched-tokens chunks, alone on the worker: its first steps sample no row,
    so they ask the vocabulary projection for none. Where that projection is a packed GEMM for
    packed_linear.cpp (the bfloat16 --dtype auto picks on a CPU with AVX512-BF16; int8 weights where VNNI
    runs), the worker once died of SIGFPE on it."""
    stack = start_stack(run_dir, *flags, "--max-batched-tokens", "32", "--kv-memory", "64MiB")
    try:
        with Client(stack.address, timeout_s=120) as client:
            dtype = client.model_info().dtype
            prompt = client.tokenize(PROMPT * 12)
            assert len(prompt) > 2 * 32
            served = [
                t
                for r in client.stream(token_ids=prompt, max_tokens=TOKENS, temperature=0.0)
                for t in r.token_ids
            ]
    finally:
        assert stack.stop() == 0, stack.log()
    assert "killed by" not in stack.log()
    config = EngineConfig(max_batched_tokens=32)
    assert served == in_process(getattr(torch, dtype), quantization, prompt, dtype, config)  # type: ignore[arg-type]


def test_auto_says_what_it_picked_and_why(run_dir: Path) -> None:
    dtype, why = cpu_features().best_dtype()
    stack = start_stack(run_dir, "--dtype", "auto", "--kv-memory", "64MiB")
    try:
        with Client(stack.address, timeout_s=60) as client:
            assert client.model_info().dtype == str(dtype).removeprefix("torch.")
    finally:
        assert stack.stop() == 0, stack.log()
    assert f"dtype: {why}" in stack.log()


@pytest.mark.parametrize(
    ("flag", "value"), [("--quantization", "int4"), ("--dtype", "float64"), ("--kv-cache-dtype", "float16")]
)
def test_a_precision_that_does_not_exist_is_refused_by_name(flag: str, value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", flag, value], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert f"argument {flag}: invalid choice: '{value}'" in done.stderr


def test_a_float32_pool_under_a_bfloat16_model_is_refused(run_dir: Path) -> None:
    """A pool wider than the model's keys and values doubles its bytes for nothing: the worker says so."""
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "worker",
        "--kv",
        "local",
        "--address",
        f"unix:{run_dir}/w.sock",
    ]
    command += ["--dtype", "bfloat16", "--kv-cache-dtype", "float32"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--kv-cache-dtype float32 under a bfloat16 model" in done.stderr
