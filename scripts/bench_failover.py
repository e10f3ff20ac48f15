"""What a worker's failure costs the streams it was serving: the gap in their token streams.

    pagedserve up --workers 2 --run-dir RUN &
    python scripts/bench_failover.py --endpoints RUN/endpoints.json [--signal SIGSTOP] [--streams 16]

It starts greedy streams with distinct chat prompts on the stack, waits until each has --after tokens,
then sends worker-0 the signal (SIGKILL: it dies and `pagedserve up` restarts it; SIGSTOP: it freezes until
its requests have moved after the frontend's --worker-timeout, then gets SIGCONT). Each stream's gap is the
time between its last response before the signal and its first one after. The streams worker-0 was running
(as many as its load said just before) are the ones with the largest gaps; it prints their gap's p50 and
max, the other streams' largest gap, and the inter-token latency before the signal, for scale. Every
stream must end OK.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.v1 import generation_pb2_grpc  # noqa: E402
from services.client import generate_request  # noqa: E402


class Stream:
    """One streamed call in a thread, with the time each response came."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, index: int, max_tokens: int) -> None:
        question = f"Write story number {index} about a lighthouse keeper and the sea, in detail."
        self.request = generate_request(
            messages=[{"role": "user", "content": question}], max_tokens=max_tokens, ignore_eos=True
        )
        self.tokens = 0
        self.times: list[float] = []
        self.status = ""
        self.thread = threading.Thread(target=self._run, args=(stub,), daemon=True)
        self.thread.start()

    def _run(self, stub: generation_pb2_grpc.GenerationStub) -> None:
        try:
            for response in stub.Generate(self.request, timeout=600):
                self.times.append(time.monotonic())
                self.tokens += len(response.token_ids)
            self.status = "OK"
        except grpc.RpcError as exc:
            self.status = f"{exc.code().name}: {exc.details()}"

    def gap_at(self, moment: float) -> float:
        """The time from its last response before moment to its first one after."""
        before = max(t for t in self.times if t <= moment)
        return min(t for t in self.times if t > moment) - before


def worker_pid(address: str) -> int:
    found = subprocess.run(["pgrep", "-f", "--", f"--address {address} "], capture_output=True, text=True)
    (pid,) = [int(line) for line in found.stdout.split()]
    return pid


def running_on(metrics_url: str) -> int:
    """The requests a worker runs, from its metrics (its gRPC service wants the stack's secret)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        families = text_string_to_metric_families(reply.read().decode())
    (family,) = [f for f in families if f.name == "pagedserve_worker_requests_running"]
    return int(family.samples[0].value)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoints", type=Path, required=True, help="endpoints.json of `pagedserve up`")
    parser.add_argument("--signal", default="SIGKILL", choices=["SIGKILL", "SIGSTOP"])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--after", type=int, default=32, help="tokens every stream has before the signal")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    endpoints = json.loads(args.endpoints.read_text())
    worker = endpoints["workers"][0]
    with grpc.insecure_channel(endpoints["frontend"]["address"]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        streams = [Stream(stub, i, args.max_tokens) for i in range(args.streams)]
        wait_for(lambda: all(s.tokens >= args.after or s.status for s in streams), 600, "the streams' tokens")
        moved = running_on(worker["metrics"])
        pid = worker_pid(worker["address"])
        lost = time.monotonic()
        os.kill(pid, getattr(signal, args.signal))
        wait_for(lambda: all(s.status for s in streams), 600, "the streams' ends")
        if args.signal == "SIGSTOP":
            os.kill(pid, signal.SIGCONT)
    failed = [s.status for s in streams if s.status != "OK"]
    if failed:
        print(f"{len(failed)} streams failed: {failed}")
        return 1
    report(streams, lost, moved, args.signal)
    return 0


def report(streams: list[Stream], lost: float, moved: int, how: str) -> None:
    gaps = sorted((s.gap_at(lost) for s in streams), reverse=True)
    affected, others = gaps[:moved], gaps[moved:]
    before = [b - a for s in streams for a, b in zip(s.times, s.times[1:], strict=False) if b <= lost]
    print(f"{how} of worker-0, which ran {moved} of {len(streams)} streams; every stream ended OK")
    print("| streams | gap p50 (ms) | gap max (ms) |")
    print("|---|---|---|")
    print(
        f"| moved ({len(affected)}) | {statistics.median(affected) * 1e3:.0f} | {max(affected) * 1e3:.0f} |"
    )
    if others:
        print(f"| others ({len(others)}) | {statistics.median(others) * 1e3:.0f} | {max(others) * 1e3:.0f} |")
    print(f"inter-token latency before the signal: p50 {statistics.median(before) * 1e3:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
