"""Fixtures the kernel tests share: the CUDA kernels' backend (only the tests marked `gpu` ask for it), the
emulator's race checker, on for every kernel test run on the CPU, and two torch threads at least."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from pagedserve.kernels.cupy_backend import CupyBackend
from pagedserve.kernels.emulator import RACECHECK_ENV
from tests.kernels.cases import DEVICE


@pytest.fixture(scope="module")
def backend() -> CupyBackend:
    return CupyBackend(DEVICE)


@pytest.fixture(autouse=True)
def racecheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the emulator, every kernel test runs under its race checker (csrc/emulate.h): a launch with a
    shared-memory race, an uninitialised shared read or a cp.async target read too early fails. An explicit
    PAGEDSERVE_EMULATE_RACECHECK=0 turns it off (faster, for a quick run of the results alone)."""
    if DEVICE.type == "cpu" and RACECHECK_ENV not in os.environ:
        monkeypatch.setenv(RACECHECK_ENV, "1")


@pytest.fixture(autouse=True)
def two_threads_at_least() -> Iterator[None]:
    """The C++ CPU kernels split their work by torch's threads (a lone sequence's heads across them, the
    prefill's tiles among them). Under pytest-xdist this process has one core (tests/cores.py) and torch one
    thread, which would leave the splits unchecked: the kernel tests run two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield
    torch.set_num_threads(threads)
