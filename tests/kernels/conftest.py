"""Fixtures the kernel tests share: the CUDA kernels' backend (only the tests marked `gpu` ask for it), and
the emulator's race checker, on for every kernel test run on the CPU."""

from __future__ import annotations

import os

import pytest

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
