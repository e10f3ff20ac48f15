"""Clients of the processes tests start: gRPC channels carrying the stack's secret, the daemon's page counts
and /metrics scrapes."""

from __future__ import annotations

import collections
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from memory_daemon.stats import PoolCounts
from memory_daemon.wire import counts_from_pb
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.plumbing.auth import secret_metadata
from tests.procs import SECRET
from tests.waiting import wait_until


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _WithSecret(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the stack's shared secret to every call, as the stack's own processes do."""

    def _add(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), *secret_metadata(SECRET)]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)  # fmt: skip

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._add(details), request)

    intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = intercept_unary_unary


def internal_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to a daemon or worker, carrying the shared secret."""
    return grpc.intercept_channel(grpc.insecure_channel(address, list(options)), _WithSecret())


def pool_counts(daemon_address: str) -> PoolCounts:
    """The daemon's counts for its one pool."""
    with internal_channel(daemon_address) as channel:
        (pool,) = memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(memory_pb2.GetStatsRequest()).pools
    return counts_from_pb(pool)


def every_page_accounted(daemon_address: str) -> bool:
    """Every page is free, idle in a worker's lease, or cached and evictable (or pinned): none is held by a
    sequence."""
    counts = pool_counts(daemon_address)
    idle = counts.free_pages + counts.leased_pages + counts.evictable_pages + counts.pinned_pages
    return idle == counts.total_pages and not any(worker.referenced_pages for worker in counts.workers)


def wait_for_every_page(daemon_address: str, timeout_s: float = 10.0) -> None:
    """Wait until `every_page_accounted`: a worker's unrefs and releases reach the daemon from its sender
    thread, a moment after the worker itself lets go of them."""
    wait_until(
        lambda: every_page_accounted(daemon_address),
        timeout_s,
        lambda: f"every page back in the daemon's books; it counts {pool_counts(daemon_address)}",
    )


class Scrape:
    """One /metrics page of a process: sample name and labels -> value."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        self.samples = {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]

    def mean(self, histogram: str) -> float:
        return self(f"{histogram}_sum") / self(f"{histogram}_count")
