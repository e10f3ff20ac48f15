"""The stack on a GPU: `pagedserve up --device cuda` (daemon, worker and frontend, the pool shared by CUDA
IPC, the CuPy kernels and CUDA graphs) gives transformers' greedy tokens on a small random model."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.models import make_model
from tests.procs import start_stack

pytestmark = pytest.mark.gpu  # skipped without a CUDA device and CuPy: tests/conftest.py

# Head dim 64, which the CUDA kernels take; two query heads per KV head.
SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


@pytest.mark.parametrize("family", ["llama", "qwen2-bias", "qwen3-qknorm"])
def test_greedy_parity_through_the_three_processes(tmp_path: Path, family: str) -> None:
    model_dir = make_model(family, tmp_path / "model", **SHAPE)
    stack = start_stack(tmp_path, "--device", "cuda", "--dtype", "float32", "--model", str(model_dir),
                        "--kv-memory", "256MiB")  # fmt: skip
    try:
        assert "pool 1:" in stack.log() and "cuda:GPU-" in stack.log()  # the pool is a CUDA IPC export
        hf = AutoModelForCausalLM.from_pretrained(model_dir).to("cuda").eval()
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            prompts = [list(range(3, 3 + n)) for n in (1, 17, 100)]
            calls = [
                stub.Complete.future(
                    generate_request(token_ids=p, max_tokens=24, ignore_eos=True, temperature=0.0)
                )
                for p in prompts
            ]  # concurrent: decode steps batch them, and run as CUDA graphs
            for prompt, call in zip(prompts, calls, strict=True):
                expected = hf.generate(
                    torch.tensor([prompt], device="cuda"),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                    max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                )[0, len(prompt):].tolist()  # fmt: skip
                assert list(call.result().token_ids) == expected, f"{family}, prompt of {len(prompt)}"
    finally:
        assert stack.stop() == 0, stack.log()
