"""A warm restart's first request against a cold one: the time to first token of one long prompt, sent to a
stack that has never seen it (cold), then to a new stack on the same disk tier folder after the first was
stopped with SIGTERM (warm: the stopped daemon kept its pool's cached pages in the tier, the new one serves
them). Both are the first request of fresh processes, so they pay the same start-up costs.

    python scripts/bench_warm_restart.py [--prompt-tokens 2048] [--repeats 3] [--out FILE.json] [UP FLAGS...]

Each stack is `pagedserve up` on the default model (flags after the known ones go to it), on a free port,
alone on the machine; the prompt is random words, a different one each repeat. Prints a table, and writes
the figures as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request

WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "garden",
    "silver",
    "engine",
    "paper",
    "window",
    "forest",
    "music",
    "bridge",
    "candle",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Stack:
    def __init__(self, disk: Path, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.run_dir = Path(tempfile.mkdtemp(prefix="ps-warm-"))
        command = [sys.executable, "-m", "services.cli", "up", "--port", str(self.port)]
        command += ["--run-dir", str(self.run_dir / "run"), "--kv-disk", str(disk), "--kv-disk-size", "4GiB"]
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            command + flags, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 300
        while b"pagedserve is up on" not in log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pagedserve up did not come up; see {log}")
            time.sleep(0.2)

    def first_token_s(self, prompt: str) -> tuple[float, int]:
        """Seconds to the first token of a greedy stream of the prompt, and its cached prompt tokens."""
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generate_request(prompt=prompt, max_tokens=2, temperature=0.0)
            began, first, cached = time.perf_counter(), None, 0
            for response in stub.Generate(request, timeout=300):
                if first is None and response.token_ids:
                    first = time.perf_counter() - began
                if response.HasField("usage"):
                    cached = response.usage.cached_prompt_tokens
        assert first is not None
        return first, cached

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=120)
        self._log.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="about this many tokens (words)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args, flags = parser.parse_known_args()
    work = Path(tempfile.mkdtemp(prefix="ps-warm-bench-"))
    rng = random.Random(5)
    rows: dict[str, list[float]] = {"cold": [], "warm restart": []}
    cached: dict[str, list[int]] = {name: [] for name in rows}
    for repeat in range(args.repeats):
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_tokens))
        for name in rows:
            stack = Stack(work / f"disk-{repeat}", flags, work / f"{repeat}-{name.split()[0]}.log")
            seconds, hits = stack.first_token_s(prompt)
            stack.stop()
            rows[name].append(seconds)
            cached[name].append(hits)
    print(f"| first request ({args.prompt_tokens} words) | TTFT median | TTFT each | cached prompt tokens |")
    print("|---|---|---|---|")
    for name, seconds in rows.items():
        each = ", ".join(f"{s:.3f}" for s in seconds)
        print(f"| {name} | {statistics.median(seconds):.3f} s | {each} | {cached[name]} |")
    if args.out:
        args.out.write_text(
            json.dumps({"ttft_s": rows, "cached_prompt_tokens": cached, "flags": flags}, indent=2)
        )


if __name__ == "__main__":
    main()
