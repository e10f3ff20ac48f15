"""Shared fixtures (a real daemon process per test that asks for one), and the rule that skips every test
marked `gpu` where this machine has no CUDA device or no CuPy (tests/devices.py), and every test marked
`cuda_kernels` where it has no C++ compiler for the kernels' emulator either."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.devices import missing_for_gpu_tests, missing_for_kernel_tests
from tests.procs import SHM_DIRS, STACKS, DaemonProcess, start_daemon


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One rule for every test marked `gpu` or `cuda_kernels`, instead of a skipif in each file."""
    for marker, missing in (("gpu", missing_for_gpu_tests), ("cuda_kernels", missing_for_kernel_tests)):
        marked = [item for item in items if item.get_closest_marker(marker)]
        if marked and (reason := missing()):
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short private folder: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ps-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(run_dir: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(run_dir)
    yield process
    status = process.stop()
    leftovers = os.listdir(process.shm_dir)
    assert status == 0, f"the daemon exited with {status}:\n{process.log()}"
    assert not leftovers, f"the daemon left pool files behind: {leftovers}"


@pytest.fixture(scope="session", autouse=True)
def remove_daemons_shm_dirs() -> Iterator[None]:
    """The daemons' pool folders in /dev/shm go with the session, whichever test started the daemon."""
    yield
    for folder in SHM_DIRS:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def stop_stacks_left_running() -> Iterator[None]:
    """A test that fails halfway must not leave its `pagedserve up` running into the next tests."""
    before = len(STACKS)
    yield
    for stack in STACKS[before:]:
        if stack.proc.poll() is None:
            stack.stop()
