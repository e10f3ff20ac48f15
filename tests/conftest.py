"""Shared fixtures (a real daemon process per test that asks for one), and the rule that skips every test
marked `gpu` where this machine has no CUDA device or no CuPy."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import STACKS, DaemonProcess, start_daemon


@functools.cache
def missing_for_gpu_tests() -> str | None:
    """Why this machine cannot run the `gpu` tests, or None when it can."""
    import torch

    missing = [
        *(["no CUDA device"] if not torch.cuda.is_available() else []),
        *(["no CuPy"] if importlib.util.find_spec("cupy") is None else []),
    ]
    return f"needs a CUDA device and CuPy: this machine has {' and '.join(missing)}" if missing else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One rule for every test marked `gpu`, instead of a skipif in each file."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and (reason := missing_for_gpu_tests()):
        for item in gpu_tests:
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
    shutil.rmtree(process.shm_dir, ignore_errors=True)
    assert status == 0, f"the daemon exited with {status}:\n{process.log()}"
    assert not leftovers, f"the daemon left pool files behind: {leftovers}"


@pytest.fixture(autouse=True)
def stop_stacks_left_running() -> Iterator[None]:
    """A test that fails halfway must not leave its `pagedserve up` running into the next tests."""
    before = len(STACKS)
    yield
    for stack in STACKS[before:]:
        if stack.proc.poll() is None:
            stack.stop()
