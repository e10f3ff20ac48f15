"""The pool on a GPU: exported by CUDA IPC from the daemon, mapped by two worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from memory_daemon.wire import counts_from_pb
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from tests.clients import internal_channel
from tests.procs import KVAgent, start_daemon

pytestmark = pytest.mark.gpu  # skipped without a CUDA device and CuPy: tests/conftest.py


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_ipc_round_trip_between_two_workers(run_dir: Path, dtype: str) -> None:
    daemon = start_daemon(run_dir, "--device", "cuda")
    agents: list[KVAgent] = []
    try:
        a, b = (
            KVAgent(daemon.address, name, model_id=f"gpu-{dtype}", device="cuda", dtype=dtype)
            for name in "ab"
        )
        agents += [a, b]
        pages_a = a("allocate", n=3)
        a("write", pages=pages_a, value=5.0)
        assert b("read", pages=pages_a) == [5.0, 5.0, 5.0]
        pages_b = b("allocate", n=2)
        b("write", pages=pages_b, value=-3.5)
        assert a("read", pages=pages_b) == [-3.5, -3.5]
        assert a("publish", tokens=list(range(8)), pages=pages_a[:2]) == 2

        a.kill()
        with internal_channel(daemon.address) as channel:
            stub = memory_pb2_grpc.MemoryDaemonStub(channel)
            (pool,) = stub.GetStats(memory_pb2.GetStatsRequest()).pools
            assert pool.storage.startswith("cuda:GPU-")
            found = b("lookup", tokens=list(range(8)))
            assert found == pages_a[:2]
            assert b("read", pages=found) == [5.0, 5.0]
            b("free", pages=pages_b + found)
            assert b.close() == 0
            counts = counts_from_pb(stub.GetStats(memory_pb2.GetStatsRequest()).pools[0])
            assert counts.cached_pages == 2
    finally:
        for agent in agents:
            agent.kill()
        assert daemon.stop() == 0
