"""The tiers below a CUDA pool: its evicted pages copied into pinned host memory and on to disk by the
daemon's cudaMemcpy2D (memory_daemon/tiers.py's CudaPageCopier), and back into the GPU pool on a lookup,
checked through a worker's own CUDA IPC map of the pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.kv_agent import SHAPE
from tests.integration.test_kv_tiers import (
    checked_counts,
    evict_everything,
    looked_up,
    media_of_prompt,
    publish_prompt,
    tier_counts,
)
from tests.procs import start_daemon

pytestmark = pytest.mark.gpu  # skipped without a CUDA device and CuPy: tests/conftest.py


def test_a_cuda_pools_pages_go_to_host_memory_and_disk_and_come_back(run_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "kv-disk"
    tiers = ("--kv-host-memory", str(2 * SHAPE.page_bytes), "--kv-disk", str(disk), "--kv-disk-size", "1MiB")
    daemon = start_daemon(run_dir, "--device", "cuda", *tiers)
    try:
        publish_prompt(daemon, "cuda")
        evict_everything(daemon, "cuda")
        assert media_of_prompt(daemon) == {"host": {1, 2}, "disk": {0}}
        assert looked_up(daemon, "cuda") == [1.0, 2.0, 3.0]
        assert (tier_counts(daemon, "host").promotions, tier_counts(daemon).promotions) == (2, 1)
        checked_counts(daemon)
    finally:
        assert daemon.stop() == 0
