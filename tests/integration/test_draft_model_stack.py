"""A real stack on the default model with `--speculative draft --draft-model`, the default model drafting
for itself: greedy (with log-probabilities) and seeded requests get speculation-off's tokens, with drafted
tokens kept. A draft pass costs a target step here, so the proposer may find that drafting does not pay and
draft only to probe: how often it drafts depends on the machine's timing, which
tests/unit/test_speculation.py fixes (and there, in float32, a self-draft's greedy drafts are all kept), so
only the first request, and the first after a restart, must keep drafted tokens here. The
draft model's KV is a lease of its own on the daemon's pool, leased anew when the daemon restarts, and every
page is back at the end. A draft model of another tokenizer, or one without `--speculative draft`, stops the
worker with a message.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.plumbing.rpc import wait_for_health
from pagedserve.v1 import generation_pb2_grpc
from services.common.default_model import default_model_dir
from tests.clients import internal_channel, pool_counts, wait_for_every_page
from tests.integration.streams import joined
from tests.integration.test_faults import pid_of
from tests.integration.test_speculative_stack import SAMPLINGS, Stub, off_and_on, run
from tests.models import make_model
from tests.procs import Stack, module_stack, run_local_worker, start_daemon, start_worker
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    draft = str(default_model_dir())
    with module_stack(
        "--kv-memory",
        "256MiB",
        "--speculative",
        "draft",
        "--draft-model",
        draft,
        "--num-speculative-tokens",
        "3",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[Stub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def fresh_worker(stack: Stack) -> None:
    """SIGKILL the worker and wait until `up` has it serving again: a proposer that has not yet measured
    whether drafting pays, so that its first request drafts."""
    back = stack.log().count("worker-0 is back")
    os.kill(pid_of(stack, "worker-0"), signal.SIGKILL)
    wait_until(
        lambda: stack.log().count("worker-0 is back") > back, 120, "the worker's restart", interval_s=0.1
    )
    wait_for_health(stack.address, 30, service="pagedserve.v1.Generation")


@SAMPLINGS
def test_the_draft_models_drafts_give_speculation_offs_tokens(
    stack: Stack, stub: Stub, sampling: dict[str, Any]
) -> None:
    """Each case on a proposer that has not measured its pay (the greedy case first, on a new stack; the
    seeded one on a worker started again), so that it drafts: else the comparison would be speculation off
    against off. Greedy drafts are kept (a self-draft's, in float32); seeded ones may all be refused."""
    if "seed" in sampling:
        fresh_worker(stack)
    *_, drafts, _, _ = off_and_on(stack, stub, 60, sampling, drafts_kept="logprobs" in sampling)
    assert drafts > 0, "nothing was drafted: speculation never ran"
    leases = [worker.name for worker in pool_counts(stack.daemon_address).workers]
    assert any(name.endswith("/draft") for name in leases), leases


def test_speculative_draft_and_draft_model_go_together() -> None:
    for flags in (["--speculative", "draft"], ["--draft-model", str(default_model_dir())]):
        done = run_local_worker(*flags)
        assert done.returncode == 2, done.stderr
        assert "--speculative draft and --draft-model DIR go together" in done.stderr


def test_a_draft_model_of_another_tokenizer_is_refused(tmp_path: Path) -> None:
    other = make_model("llama", tmp_path / "other")
    done = run_local_worker(
        "--speculative", "draft", "--draft-model", str(other), "--address", f"unix:{tmp_path}/w.sock"
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot start: the draft model" in done.stderr
    assert "must have the target model's tokenizer" in done.stderr


def test_a_draft_model_of_a_smaller_vocabulary_is_refused(tmp_path: Path) -> None:
    """Its tokenizer is the target's, but ids past its vocabulary would index nothing in its embedding."""
    target = make_model("llama", tmp_path / "target")
    draft = make_model("llama", tmp_path / "draft", vocab_size=256)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(target / name, draft / name)
    done = run_local_worker(
        *("--model", str(target), "--speculative", "draft", "--draft-model", str(draft)),
        *("--address", f"unix:{tmp_path}/w.sock"),
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "has a vocabulary of 256, smaller than the target's 512" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_model_that_does_not_fit_its_config_stops_the_worker_in_one_line(tmp_path: Path) -> None:
    """An operator's broken model folder (a tensor of another shape than config.json gives, a tensor
    missing, a size of 0) stops the worker at start with one line that names the folder and the fault, not
    a traceback, and not a worker that reports SERVING and fails every request."""
    folder = make_model("llama", tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.post_attention_layernorm.weight"] = torch.ones(7)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    done = run_local_worker("--model", str(folder), "--address", f"unix:{tmp_path}/w.sock")
    assert done.returncode == 1, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert line.endswith(
        f"cannot start: {folder}: model.layers.1.post_norm is [7], where the config.json gives [64]"
    ), line
    assert "Traceback" not in done.stderr


def test_the_draft_models_pool_takes_the_targets_kv_cache_dtype(run_dir: Path) -> None:
    """A float32 model over a bfloat16 pool drafting for itself: the draft's lease is on the same bfloat16
    pool (the same model, so the same shape), not on a float32 pool of twice the bytes."""
    daemon = start_daemon(run_dir)
    try:
        flags = ("--kv-memory", "32MiB", "--kv-cache-dtype", "bfloat16", "--speculative", "draft")
        worker = start_worker(run_dir, daemon.address, *flags, "--draft-model", str(default_model_dir()))
        try:
            with internal_channel(daemon.address) as channel:
                stats = memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(memory_pb2.GetStatsRequest())
            (pool,) = stats.pools
            assert pool.shape.dtype == "bfloat16"
            assert sorted(usage.name for usage in pool.workers) == ["worker", "worker/draft"]
        finally:
            assert worker.stop() == 0
    finally:
        assert daemon.stop() == 0


def test_after_the_daemon_restarts_the_draft_model_leases_anew(stack: Stack, stub: Stub) -> None:
    """The daemon is SIGKILLed and started again: the worker leases both pools anew, and drafts again."""
    os.kill(pid_of(stack, "daemon"), signal.SIGKILL)
    wait_until(lambda: "re-attached to the memory daemon" in stack.log(), 90, "the worker re-attaching")
    wait_for_health(stack.address, 30, service="pagedserve.v1.Generation")
    leases = [worker.name for worker in pool_counts(stack.daemon_address).workers]
    assert any(name.endswith("/draft") for name in leases), leases
    on, (_, drafts, _, accepted) = run(stack, stub, max_tokens=30, temperature=0.0)
    assert drafts > 0 and accepted > 0 and len(joined(on)[1]) == 30  # a new pool: it measures anew
    wait_for_every_page(stack.daemon_address)
