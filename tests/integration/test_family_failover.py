"""Failover for the families beyond Llama, on a real stack: a greedy stream of a random Gemma 2 (sliding and
full layers: a block table for each group of layers) and of a random Qwen3-MoE, its worker SIGKILLed
mid-stream, ends OK with exactly transformers' tokens; the other worker finds its prompt and its tokens so
far in the daemon's prefix cache, and every page comes back.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.clients import Scrape, internal_channel, pool_counts, wait_for_every_page
from tests.integration.failover_calls import finish, pid_of_worker, start
from tests.integration.streams import worker_load
from tests.models import make_model
from tests.procs import start_stack
from tests.waiting import wait_until

PROMPT = list(range(5, 45))  # longer than Gemma 2's window of 24
NEW_TOKENS = 400
KILL_AFTER = 40  # tokens the stream has had when its worker is lost: with the prompt, 4 full pages at least
# 8 layers of 256: slow enough a decode that the stream is still running when its worker is found and killed.
SHAPE = {"hidden_size": 256, "num_hidden_layers": 8, "max_position_embeddings": 512}


@pytest.mark.parametrize("family", ["gemma2-softcap", "qwen3-moe"])
def test_a_stream_of_the_family_survives_the_loss_of_its_worker(family: str, tmp_path: Path) -> None:
    layers = {"layer_types": ["sliding_attention", "full_attention"] * 4, "sliding_window": 24}
    overrides = {**SHAPE, **(layers if family == "gemma2-softcap" else {"mlp_only_layers": [1, 3, 5, 7]})}
    model_dir = make_model(family, tmp_path / "model", **overrides)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    expected = hf.generate(
        torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
    )[0, len(PROMPT):].tolist()  # fmt: skip
    flags = ("--workers", "2", "--max-failovers", "1", "--worker-timeout", "3")
    stack = start_stack(tmp_path, "--model", str(model_dir), "--kv-memory", "64MiB", *flags)
    try:
        both_up = lambda: all(f"(worker-{i}) is up" in stack.log() for i in range(2))  # noqa: E731
        wait_until(both_up, 120, lambda: f"both workers up:\n{stack.log()}")
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generate_request(
                token_ids=PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0
            )
            (call,) = start(stub, [request])
            wait_until(lambda: len(call.token_ids()) >= KILL_AFTER or call.code is not None, 120, "tokens")
            assert call.code is None, f"the stream ended before its worker could be lost: {call.details}"
            (serving,) = [i for i in range(2) if worker_load(stack, i).running]
            hits = pool_counts(stack.daemon_address).prefix_hit_pages
            seen = len(call.token_ids())  # the worker has the KV of all but the last, at least
            os.kill(pid_of_worker(stack, serving), signal.SIGKILL)
            finish([call])
        assert call.code == grpc.StatusCode.OK, call.details
        assert call.token_ids() == expected
        assert Scrape(stack.metrics_url("frontend"))("pagedserve_failovers_total", outcome="moved") == 1
        # The other worker found the full pages of 16 of the prompt and of the tokens so far, not the prompt's
        # 2 alone (Gemma 2's sliding layers, a group of their own, add the pages in their window).
        assert pool_counts(stack.daemon_address).prefix_hit_pages - hits >= (len(PROMPT) + seen - 1) // 16
        with internal_channel(stack.daemon_address) as daemon:
            memory_pb2_grpc.MemoryDaemonStub(daemon).GetStats(
                memory_pb2.GetStatsRequest(check_invariants=True)
            )
        wait_for_every_page(stack.daemon_address, 30)
    finally:
        assert stack.stop() == 0, stack.log()
