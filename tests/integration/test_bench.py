"""`pagedserve bench` against a real stack, briefly, and what its JSON says."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import REPO, Stack, free_port, module_stack
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--kv-memory", "256MiB") as running:
        yield running


def bench(stack: Stack, out: Path, *args: str) -> dict:
    command = [sys.executable, "-m", "services.cli", "bench", "--address", stack.address, "--out", str(out)]
    command += ["--endpoints", str(stack.run_dir / "endpoints.json"), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| pagedserve |" in done.stdout
    assert (out / "bench.png").stat().st_size > 10_000
    return json.loads((out / "bench.json").read_text())


def check_run(run: dict, requests: int) -> None:
    summary = run["summary"]
    assert summary["requests"] == summary["completed"] == requests and summary["errors"] == {}
    for latency in ("ttft_s", "tpot_s", "itl_s"):
        p = summary[latency]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (latency, p)
    assert (
        summary["output_tokens_per_s"] > 0 and summary["goodput_requests_per_s"] <= summary["requests_per_s"]
    )


def test_concurrency_levels_with_the_transformers_baselines(stack: Stack, tmp_path: Path) -> None:
    result = bench(stack, tmp_path, "--requests", "6", "--concurrency", "2,4", "--input-len", "16-48",
                   "--output-len", "4-12", "--baseline", "hf")  # fmt: skip
    runs = result["runs"]
    assert [(run["system"], run["load"]) for run in runs] == [
        ("pagedserve", 2), ("pagedserve", 4), ("hf-static", 2), ("hf-static", 4),
        ("hf-continuous", 2), ("hf-continuous", 4),
    ]  # fmt: skip
    for run in runs:
        check_run(run, 6)
    for run in runs[:2]:
        kv = run["kv"]
        assert 0.0 <= kv["kv_fragmentation"] <= 1.0 and kv["kv_fragmentation_samples"] > 0
        assert kv["preemptions"] == 0
    assert runs[0]["summary"]["output_tokens"] == runs[2]["summary"]["output_tokens"]  # the same work


def test_poisson_arrivals_behind_a_shared_prefix(stack: Stack, tmp_path: Path) -> None:
    result = bench(stack, tmp_path, "--workload", "shared-prefix", "--requests", "8", "--rate", "4",
                   "--prefix-len", "96", "--input-len", "8-24", "--output-len", "4-8")  # fmt: skip
    (run,) = result["runs"]
    check_run(run, 8)
    assert result["config"]["load"] == "rate (req/s)"
    # Requests that arrive after the first one's prefill find the system prompt's 6 pages in the cache.
    assert 0.5 < run["kv"]["prefix_hit_rate"] <= 1.0
    assert run["summary"]["cached_prompt_tokens"] >= 5 * 96


@pytest.fixture
def openai_server(stack: Stack, tmp_path: Path) -> Iterator[str]:
    """An OpenAI-compatible server in front of the same stack (tests/openai_adapter.py), as a process."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "adapter.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.openai_adapter", stack.address, str(port)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    try:
        wait_until(lambda: _answers(url) or proc.poll() is not None, 60, "the adapter to listen")
        assert proc.poll() is None, (tmp_path / "adapter.log").read_text()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=1):
            return True
    except OSError:
        return False


def test_an_openai_target_gets_the_same_requests_in_the_same_table(
    stack: Stack, openai_server: str, tmp_path: Path
) -> None:
    result = bench(stack, tmp_path, "--target", f"pagedserve={stack.address}", "--target",
                   f"openai={openai_server}", "--requests", "5", "--concurrency", "2", "--input-len", "16-48",
                   "--output-len", "4-12")  # fmt: skip
    grpc_run, http_run = result["runs"]
    assert [(run["system"], run["load"]) for run in result["runs"]] == [("pagedserve", 2), ("openai", 2)]
    for run in result["runs"]:
        check_run(run, 5)
    assert grpc_run["summary"]["output_tokens"] == http_run["summary"]["output_tokens"]  # the exact lengths
    assert http_run["kv"] is None or http_run["kv"].get("kv_fragmentation_samples", 0) == 0
    assert result["config"]["targets"] == {"pagedserve": stack.address, "openai": openai_server}
