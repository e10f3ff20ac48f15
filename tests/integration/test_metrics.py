"""Prometheus metrics of a real stack: `pagedserve up` writes endpoints.json, real requests move the
numbers, and each process's /metrics is scraped over HTTP and parsed with prometheus_client's parser."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from services.common.default_model import default_model_dir
from tests.clients import Scrape
from tests.procs import Stack, module_stack, start_stack
from tests.waiting import wait_until

PAGE_SIZE = 16  # the launcher's default
LONG_PROMPT = "The quick brown fox jumps over the lazy dog, and the dog does not mind at all. " * 8
SHORT_IDS = list(range(100, 110))  # under one page: no prefix lookup, no cached tokens
ENDLESS = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


def eventually(url: str, ready: Callable[[Scrape], bool], timeout_s: float = 15) -> Scrape:
    """Scrape until ready: counters move when handlers finish and the daemon snapshots every 0.5 s."""
    return wait_until(
        lambda: latest if ready(latest := Scrape(url)) else None,
        timeout_s,
        f"the metrics at {url} to settle",
        interval_s=0.1,
    )


def test_no_metrics_writes_null_endpoints(tmp_path: Path) -> None:
    # First in the file, so that its stack is gone before the module's stack starts.
    default_model_dir()
    stack = start_stack(tmp_path, "--kv-memory", "64MiB", "--no-metrics")
    try:
        endpoints = stack.endpoints()
        assert endpoints == {
            "frontend": {"address": stack.address, "metrics": None, "gateway_address": None},
            "daemon": {"address": stack.daemon_address, "metrics": None},
            "workers": [{"name": "worker-0", "address": stack.worker_address(0), "metrics": None}],
        }
        assert "metrics on http" not in stack.log() and "| metrics:" not in stack.log()
    finally:
        assert stack.stop() == 0, stack.log()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--kv-memory", "128MiB") as running:
        yield running


@pytest.fixture(scope="module")
def endpoints(stack: Stack) -> dict[str, Any]:
    return stack.endpoints()


@dataclass
class Traffic:
    ok: list[pb.Usage]  # the usage of each request that ended OK
    streamed_latencies: float  # inter-token latencies the frontend observed for the first request
    streamed_tokens: float  # tokens the worker counted as sampled for it
    mid_stream: Scrape  # the worker's metrics while one request ran


@pytest.fixture(scope="module")
def traffic(stack: Stack, endpoints: dict[str, Any]) -> Traffic:
    """One streamed request, one refused, one cancelled, one past its deadline, and one prompt twice."""
    frontend_metrics, worker_metrics = endpoints["frontend"]["metrics"], endpoints["workers"][0]["metrics"]
    latencies, sampled = (
        "pagedserve_inter_token_latency_seconds_count",
        "pagedserve_worker_generation_tokens_total",
    )
    latencies_before, sampled_before = Scrape(frontend_metrics)(latencies), Scrape(worker_metrics)(sampled)
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        streamed = list(stub.Generate(generate_request("Name three colors.", max_tokens=12, ignore_eos=True)))
        ok = [streamed[-1].usage]
        tokens = ok[0].completion_tokens
        # Counted as the tokens go out, and (the worker's) in a snapshot taken after each step: may lag.
        streamed_latencies = eventually(
            frontend_metrics, lambda m: m(latencies) - latencies_before >= tokens - 1
        )
        streamed_tokens = eventually(worker_metrics, lambda m: m(sampled) - sampled_before >= tokens)

        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(generate_request()))  # no input
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        call = stub.Generate(generate_request(token_ids=SHORT_IDS, **ENDLESS))
        next(call), next(call)
        mid_stream = Scrape(worker_metrics)
        call.cancel()

        with pytest.raises(grpc.RpcError) as late:
            list(stub.Generate(generate_request(token_ids=SHORT_IDS[::-1], **ENDLESS), timeout=2.0))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        for _ in range(2):
            ok.append(stub.Complete(generate_request(LONG_PROMPT, max_tokens=4, temperature=0.0)).usage)
    assert ok[-1].cached_prompt_tokens > 0, "the repeated prompt should have hit the prefix cache"
    return Traffic(
        ok,
        streamed_latencies(latencies) - latencies_before,
        streamed_tokens(sampled) - sampled_before,
        mid_stream,
    )


def test_endpoints_name_every_process(stack: Stack, endpoints: dict[str, Any]) -> None:
    assert endpoints["frontend"]["address"] == stack.address
    assert endpoints["daemon"]["address"] == stack.daemon_address
    assert [(w["name"], w["address"]) for w in endpoints["workers"]] == [("worker-0", stack.worker_address())]
    (worker,) = endpoints["workers"]
    urls = [endpoints["frontend"]["metrics"], endpoints["daemon"]["metrics"], worker["metrics"]]
    assert len(set(urls)) == 3 and all(url.startswith("http://127.0.0.1:") for url in urls)
    assert f"metrics: frontend {urls[0]}, daemon {urls[1]}, worker-0 {urls[2]}" in stack.log()
    for url in urls:  # every process also logs where its metrics are
        assert f"metrics on {url}" in stack.log()


def test_frontend_latency_statuses_and_tokens(traffic: Traffic, endpoints: dict[str, Any]) -> None:
    url = endpoints["frontend"]["metrics"]
    m = eventually(url, lambda m: m("pagedserve_requests_total", code="CANCELLED") == 1)
    codes = {"OK": 3, "INVALID_ARGUMENT": 1, "CANCELLED": 1, "DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 0}
    for code, count in codes.items():
        assert m("pagedserve_requests_total", code=code) == count, code
    assert m("pagedserve_prompt_tokens_total") == sum(u.prompt_tokens for u in traffic.ok)
    assert m("pagedserve_generation_tokens_total") == sum(u.completion_tokens for u in traffic.ok)

    # A first token for the three OK requests and the cancelled one; the late one may have had one.
    assert 4 <= m("pagedserve_time_to_first_token_seconds_count") <= 5
    assert 0 < m.mean("pagedserve_time_to_first_token_seconds") < 10
    # One per token after the first: exactly so for the first request; the cancelled one had a second.
    assert traffic.streamed_latencies == traffic.ok[0].completion_tokens - 1 == 11
    later_tokens = sum(u.completion_tokens - 1 for u in traffic.ok) + 1
    assert m("pagedserve_inter_token_latency_seconds_count") >= later_tokens
    assert 0 < m.mean("pagedserve_inter_token_latency_seconds") < 5
    assert m("pagedserve_request_queue_seconds_count") == 5  # every request but the refused one was admitted
    assert m.mean("pagedserve_request_queue_seconds") < 1  # nothing had to wait
    assert m("pagedserve_e2e_request_latency_seconds_count") == 3
    assert m("pagedserve_e2e_request_latency_seconds_sum") > 0
    assert m("pagedserve_requests_running") == 0 and m("pagedserve_requests_waiting") == 0


def test_worker_load_kv_slots_and_tokens(traffic: Traffic, endpoints: dict[str, Any]) -> None:
    mid = traffic.mid_stream
    assert mid("pagedserve_worker_requests_running") == 1
    assert mid("pagedserve_worker_kv_pages_in_use") > 0
    assert 0 < mid("pagedserve_worker_kv_slots_used") <= mid("pagedserve_worker_kv_slots_allocated")

    url = endpoints["workers"][0]["metrics"]
    m = eventually(url, lambda m: m("pagedserve_worker_kv_pages_in_use") == 0)
    assert m("pagedserve_worker_requests_running") == 0 and m("pagedserve_worker_requests_waiting") == 0
    assert m("pagedserve_worker_kv_slots_allocated") == m("pagedserve_worker_kv_slots_used") == 0
    cached = sum(u.cached_prompt_tokens for u in traffic.ok)
    assert m("pagedserve_worker_cached_prompt_tokens_total") == cached > 0
    # The OK prompts and the cancelled one's; the late one's too if it was scheduled before its deadline.
    prompts = sum(u.prompt_tokens for u in traffic.ok) + len(SHORT_IDS)
    assert m("pagedserve_worker_prompt_tokens_total") in (prompts, prompts + len(SHORT_IDS))
    generated = m("pagedserve_worker_generation_tokens_total")
    assert traffic.streamed_tokens == traffic.ok[0].completion_tokens  # exactly: nothing else ran meanwhile
    assert generated >= sum(u.completion_tokens for u in traffic.ok) + 2
    steps = m("pagedserve_worker_engine_steps_total")
    assert steps == m("pagedserve_worker_step_seconds_count") == m("pagedserve_worker_batch_tokens_count") > 0
    assert m("pagedserve_worker_batch_tokens_sum") >= generated  # every sampled row had a token in its step
    assert 0 < m.mean("pagedserve_worker_step_seconds") < 5
    assert m("pagedserve_worker_preemptions_total") == 0


def test_daemon_pages_and_prefix_cache(traffic: Traffic, endpoints: dict[str, Any]) -> None:
    url = endpoints["daemon"]["metrics"]
    m = eventually(url, lambda m: m("pagedserve_kv_prefix_hits_total", pool="1") > 0)
    pages = {
        state: m("pagedserve_kv_pages", pool="1", state=state)
        for state in ("free", "leased", "shared", "cached", "evictable")
    }
    capacity = m("pagedserve_kv_pages_total_capacity", pool="1")
    assert pages["free"] + pages["leased"] + pages["shared"] == capacity
    assert 0 < pages["evictable"] <= pages["cached"] <= pages["shared"]
    assert m("pagedserve_kv_workers", pool="1") == 1
    assert m("pagedserve_kv_prefix_hits_total", pool="1") == 1  # only the repeated prompt hit
    assert m("pagedserve_kv_prefix_lookups_total", pool="1") >= 2
    hit_pages = m("pagedserve_kv_prefix_hit_pages_total", pool="1")
    assert hit_pages * PAGE_SIZE == sum(u.cached_prompt_tokens for u in traffic.ok)
    assert m("pagedserve_kv_prefix_queried_pages_total", pool="1") >= hit_pages
    assert m("pagedserve_kv_evictions_total", pool="1") == 0


def test_cancels_racing_writes_count_as_cancelled(stack: Stack, endpoints: dict[str, Any]) -> None:
    """A client that cancels while a message is on its way fails the frontend's write: that is its cancel,
    not an INTERNAL error (the soak once counted 76 in 30 minutes)."""
    url = endpoints["frontend"]["metrics"]
    before = Scrape(url)
    request = generate_request(prompt="Count to one hundred:", max_tokens=64, ignore_eos=True)
    calls = 0
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for _ in range(12):
            streams = [stub.Generate(request) for _ in range(32)]
            for stream in streams:
                next(stream)  # its first token: the next messages are being written
            for stream in streams:
                stream.cancel()
            calls += len(streams)
    after = eventually(
        url,
        lambda s: (
            s("pagedserve_requests_total", code="CANCELLED")
            - before("pagedserve_requests_total", code="CANCELLED")
            + s("pagedserve_requests_total", code="INTERNAL")
            - before("pagedserve_requests_total", code="INTERNAL")
            >= calls
        ),
    )
    assert after("pagedserve_requests_total", code="INTERNAL") == before(
        "pagedserve_requests_total", code="INTERNAL"
    )
