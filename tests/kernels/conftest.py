"""Fixtures the kernel tests share: the CUDA kernels' backend (only the tests marked `gpu` ask for it)."""

from __future__ import annotations

import pytest

from pagedserve.kernels.cupy_backend import CupyBackend
from tests.kernels.cases import DEVICE


@pytest.fixture(scope="module")
def backend() -> CupyBackend:
    return CupyBackend(DEVICE)
