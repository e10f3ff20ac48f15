"""A running `pagedserve gateway` (SMG) in front of stacks' gateway listeners, for the tests: started with
deterministic routing and a control-plane key of its own, so that a test can ask which workers it holds
ready, and with its metrics on a known port, so that a test can wait for the KV events it has applied."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai

from services.launcher import free_port, http_ready
from tests.clients import Scrape
from tests.procs import REPO, Stack
from tests.waiting import wait_until

ADMIN_KEY = secrets.token_urlsafe(16)


class Gateway:
    def __init__(self, stacks: list[Stack], log_path: Path) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_port = free_port("127.0.0.1")
        command = [sys.executable, "-m", "services.cli", "gateway", "--port", str(self.port)]
        command += ["--metrics-port", str(self.metrics_port)]
        command += [arg for stack in stacks for arg in ("--stack", stack.gateway_address)]
        command += ["--health-check-interval", "1", "--log-level", "info", "--"]
        # Deterministic routing for the tests: no share of requests set aside for new workers, no shedding.
        command += ["--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"]
        command += [
            "--disable-worker-overload-protection",
            "--control-plane-api-keys",
            f"t:t:admin:{ADMIN_KEY}",
        ]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_until(lambda: self.ready_workers() == len(stacks), 120, self.describe)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def ready_workers(self) -> int:
        assert self.proc.poll() is None, self.log_path.read_text(errors="replace")
        if not http_ready(self.url):
            return 0
        request = urllib.request.Request(
            f"{self.url}/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        with urllib.request.urlopen(request, timeout=5) as reply:
            workers = json.load(reply)["workers"]
        return sum(worker["status"] == "ready" for worker in workers)

    def stored_blocks(self, stack: Stack) -> float:
        """The blocks SMG has applied from the stored events of stack's node (its KV index's view)."""
        scrape = Scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")
        labels = {"worker": f"grpc://{stack.gateway_address}", "op": "stored"}
        try:
            return scrape("smg_kv_event_blocks_total", **labels)
        except KeyError:  # none applied yet
            return 0.0

    def describe(self) -> str:
        return f"the gateway to register every stack:\n{self.log_path.read_text(errors='replace')[-3000:]}"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)
