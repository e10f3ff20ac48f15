"""Benchmark the memory layer: lease and free throughput over gRPC, and the per-token cost of local
sub-allocation with the daemon against the in-process pool.

    python scripts/bench_kv.py [--address ADDRESS] [--seconds 2]

Without --address it starts a daemon on a unix socket and stops it afterwards. Machines are noisy: read the
ratios within one run, not the absolute figures across runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory_daemon.shape import PoolShape  # noqa: E402
from memory_daemon.wire import shape_to_pb  # noqa: E402
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc  # noqa: E402
from pagedserve.plumbing.rpc import wait_for_health  # noqa: E402
from services.worker.kv.base import KVCache  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.kv.remote import DaemonKVCache  # noqa: E402

# SmolLM2-135M's KV geometry: 30 layers, 3 KV heads of 64, fp32, 16 tokens a page.
SHAPE = PoolShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", page_size=16)
NUM_PAGES = 1024


def timed(seconds: float, step: Callable[[], int]) -> tuple[float, int, int]:
    """Run step (which returns its unit count) for about `seconds`; return (elapsed, steps, units)."""
    steps, units, start = 0, 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        units += step()
        steps += 1
    return elapsed, steps, units


def lease_and_free(stub: memory_pb2_grpc.MemoryDaemonStub, lease_id: str, batch: int) -> int:
    pages = stub.Lease(memory_pb2.LeaseRequest(lease_id=lease_id, need=batch)).pages
    assert len(pages) >= batch, "the pool is too small for this batch"
    stub.Update(memory_pb2.UpdateRequest(lease_id=lease_id, release=pages))
    return len(pages)


def bench_rpc(address: str, seconds: float) -> None:
    print(
        "\nLease + release over gRPC: one Lease and one Update a round trip (a grant rounds up to the refill)"
    )
    print(f"{'pages a lease':>14} {'round trips/s':>14} {'pages/s':>12} {'us a page':>10}")
    with grpc.insecure_channel(address) as channel:
        stub = memory_pb2_grpc.MemoryDaemonStub(channel)
        request = memory_pb2.AttachRequest(
            worker_name="bench-rpc", model_id="bench", shape=shape_to_pb(SHAPE), num_pages=NUM_PAGES
        )
        attach = stub.Attach(request)
        lease_id = next(attach).attached.lease_id
        for batch in (1, 16, 64, 256):
            elapsed, trips, pages = timed(seconds, lambda batch=batch: lease_and_free(stub, lease_id, batch))
            row = f"{pages / trips:>14.0f} {trips / elapsed:>14,.0f} {pages / elapsed:>12,.0f}"
            print(f"{row} {elapsed / pages * 1e6:>10.2f}")
        attach.cancel()


def decode_pages(cache: KVCache, sequences: int, tokens: int) -> int:
    """Allocate pages as `sequences` sequences decode `tokens` tokens each, then free them; returns tokens."""
    tables: list[list[int]] = [[] for _ in range(sequences)]
    for position in range(tokens):
        if position % cache.page_size == 0:
            for table in tables:
                pages = cache.allocate(1)
                assert pages is not None, "the pool is too small"
                table.extend(pages)
    for table in tables:
        cache.free(table)
    return sequences * tokens


def bench_local(address: str, seconds: float) -> None:
    print("\nLocal sub-allocation: 16 sequences decoding 512 tokens, one page per 16 tokens")
    print(f"{'pool':>12} {'ns per token':>13} {'ns per page':>12} {'RPCs per 1k tokens':>19}")
    remote = DaemonKVCache(
        address, model_id="bench", shape=SHAPE, worker_name="bench-local", num_pages=NUM_PAGES
    )
    local = LocalKVCache(SHAPE, NUM_PAGES)
    results = {}
    for name, cache in (("in-process", local), ("daemon", remote)):
        decode_pages(cache, 16, 512)  # warm up: the refill size settles
        cache.flush()
        calls_before = sum(remote.rpc_counts.values())
        elapsed, _, tokens = timed(seconds, lambda cache=cache: decode_pages(cache, 16, 512))
        cache.flush()
        calls = sum(remote.rpc_counts.values()) - calls_before
        results[name] = elapsed / tokens * 1e9
        pages = tokens // SHAPE.page_size
        print(
            f"{name:>12} {results[name]:>13.1f} {elapsed / pages * 1e9:>12.0f} {calls / tokens * 1000:>19.3f}"
        )
    print(f"daemon / in-process, per token: {results['daemon'] / results['in-process']:.2f}x")
    remote.close()
    local.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running daemon; by default one is started on a unix socket")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    args = parser.parse_args()
    daemon = None
    address = args.address
    if address is None:
        run_dir = tempfile.mkdtemp(prefix="ps-bench-")
        address = f"unix:{run_dir}/daemon.sock"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "memory_daemon", "--address", address, "--log-level", "WARNING"], cwd=ROOT
        )
    try:
        wait_for_health(address, timeout_s=30)
        print(f"memory daemon at {address}; pool of {NUM_PAGES} pages of {SHAPE}")
        bench_rpc(address, args.seconds)
        bench_local(address, args.seconds)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
