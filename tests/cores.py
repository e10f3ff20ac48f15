"""A pytest plugin (pyproject.toml's addopts load it): under pytest-xdist, each test process runs on its own
share of the cores, and so do the stacks its tests start. torch sizes its thread team to the cores it may
run on; two processes' teams on the same cores spin waiting for each other (services/up.py's shared_cores
says how badly), and a test took 150 s where it takes 7 alone."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests() -> None:
    """Before the conftests import torch, whose OpenMP runtime reads the cores once, when it loads."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, share(cores, int(worker.removeprefix("gw")), int(count)))


def share(cores: list[int], index: int, workers: int) -> list[int]:
    """Worker `index`'s cores: every `workers`-th, or one, shared, when there are more workers than cores."""
    return cores[index::workers] or [cores[index % len(cores)]]
