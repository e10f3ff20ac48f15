"""`pagedserve bench` against a real stack, briefly, and what its JSON says."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import REPO, Stack, module_stack


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


def test_sessions_of_several_turns_find_their_history_cached(stack: Stack, tmp_path: Path) -> None:
    """multi-turn: each turn sends the session's whole history, after the turn before has finished; with a
    pool that holds every session, the cache hits what a cache that forgets nothing would (each turn's
    previous prompt, in full pages), and the JSON says that ideal."""
    # A seed of its own: the module's stack keeps the other tests' prompts cached (it has no gateway listener
    # to flush it), and the same seed would start this workload's random stream where theirs started.
    result = bench(stack, tmp_path, "--workload", "multi-turn", "--requests", "3", "--turns", "3",
                   "--seed", "17", "--concurrency", "3", "--input-len", "20-40",
                   "--output-len", "4-8")  # fmt: skip
    (run,) = result["runs"]
    check_run(run, 9)
    ideal = result["config"]["ideal_prefix_hit_rate"]["3"]
    summary = run["summary"]
    assert 0.3 < ideal < 0.8
    assert summary["cached_prompt_tokens"] / summary["prompt_tokens"] == pytest.approx(ideal)


def test_an_endpoints_file_up_has_not_written_yet_is_waited_for(stack: Stack, tmp_path: Path) -> None:
    """`pagedserve up` writes endpoints.json once every process is up, which can be after the frontend
    answers: a bench started beside `up` waits for the file within --wait, reads the worker's metrics it
    names (the KV samples), and says so plainly where it never comes."""
    late = tmp_path / "run" / "endpoints.json"
    late.parent.mkdir()
    command = [sys.executable, "-m", "services.cli", "bench", "--address", stack.address,
               "--requests", "2", "--concurrency", "2", "--input-len", "8-16", "--output-len", "2-4",
               "--seed", "23"]  # fmt: skip
    waiting = subprocess.Popen(
        [*command, "--endpoints", str(late), "--wait", "60", "--out", str(tmp_path / "late")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    # Long enough for the bench to have started, reached the frontend and looked for the file (about 3 s
    # here): without the wait it fails by then, reading a file that is not there.
    time.sleep(10)
    assert waiting.poll() is None
    late.write_text((stack.run_dir / "endpoints.json").read_text())
    output, _ = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, output
    (run,) = json.loads((tmp_path / "late" / "bench.json").read_text())["runs"]
    check_run(run, 2)
    # The worker's counters that the file names, read before the run and after it (the gauges are sampled
    # only while it lasts, which two short requests may not span).
    assert run["kv"] is not None and run["kv"]["prefix_hit_rate"] is not None

    never = subprocess.run(
        [*command, "--endpoints", str(tmp_path / "absent.json"), "--wait", "1", "--out", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert never.returncode != 0
    assert "absent.json does not exist" in never.stderr and "Traceback" not in never.stderr
