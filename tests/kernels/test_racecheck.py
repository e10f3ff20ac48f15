"""The emulator's race checker (PAGEDSERVE_EMULATE_RACECHECK=1, csrc/emulate.h) on the tensor-core decode.

Round-robin fibers hide a missing barrier: the writer usually runs first. The checker must fail a launch of
the decode with either `__syncwarp()` deleted, or the `__syncthreads()` after the page ids and the query
are loaded, or with the query's cp.async left out (a read of shared memory no thread wrote), on Hopper's
three-stage pipeline and on the two stages sm_86 and sm_89 run; the decode as written passes, and runs
equal to the torch reference.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from pagedserve.kernels import emulator
from pagedserve.kernels.cupy_backend import CupyBackend
from pagedserve.kernels.emulator import EmulatorError
from pagedserve.kernels.nvrtc import source
from pagedserve.kernels.tuning import tuning_for
from tests.kernels.cases import DEVICE, assert_close, attention_case, run_attention

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the checker is the emulator's, on the CPU")

WITHOUT_BARRIER = {
    # The tile a warp is about to read was copied in by its lanes' cp.async: each lane's copy is ordered
    # for the others only by the warp barrier after the wait.
    "the __syncwarp after a tile's copies": (
        r"cp_async_wait<STAGES - 1>\(\);\n\s*__syncwarp\(\);",
        "cp_async_wait<STAGES - 1>();",
    ),
    # A later iteration refills the stage this one read: the lanes must all be done reading it first.
    "the __syncwarp before a stage is refilled": (
        r"\n\s*__syncwarp\(\);  // the warp is done with this stage[^\n]*",
        "",
    ),
    # Every warp reads the page ids and the query that all the block's threads loaded.
    "the __syncthreads after the page ids and the query": (
        r"cp_async_wait<0>\(\);\n\s*__syncthreads\(\);\n  unsigned q_frag",
        "cp_async_wait<0>();\n  unsigned q_frag",
    ),
    # A read of shared memory that no thread of the block wrote: the query tile, never copied in.
    "the query's copies": (r"\n\s*cp_async_16\(&q_tile\[[^\n]*", ""),
}


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(emulator.RACECHECK_ENV, "1")  # as tests/kernels/conftest.py sets it: said here too
    yield
    emulator._kernel.cache_clear()


def decode(stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor-core decode (bfloat16) of sequences across page boundaries, one long enough for each warp to
    refill its stages (44 tiles of 16 keys); (actual, expected)."""
    backend = CupyBackend(DEVICE)
    backend.tuning = tuning_for(86 if stages == 2 else 90)
    assert backend.tuning.decode_stages == stages
    case = attention_case(2, [2 * 16 + 3, 1, 700, 100], [], 16, 64, 4, torch.bfloat16)
    return run_attention(case, backend)


def with_source(monkeypatch: pytest.MonkeyPatch, pattern: str, replacement: str) -> None:
    """The decode's source with one barrier (or copy) taken out, for the next launches."""
    text = source("paged_decode_mma")
    changed, count = re.subn(pattern, replacement, text)
    assert count == 1, f"{pattern!r} matched {count} times"
    monkeypatch.setattr(
        emulator, "source", lambda name: changed if name == "paged_decode_mma" else source(name)
    )
    emulator._kernel.cache_clear()


@pytest.mark.parametrize("stages", [3, 2])
def test_the_decode_as_written_has_no_race(checked: None, stages: int) -> None:
    actual, expected = decode(stages)
    assert_close(actual, expected, torch.bfloat16)


@pytest.mark.parametrize("stages", [3, 2])
@pytest.mark.parametrize("missing", list(WITHOUT_BARRIER))
def test_the_checker_fails_the_decode_without(
    checked: None, monkeypatch: pytest.MonkeyPatch, missing: str, stages: int
) -> None:
    with_source(monkeypatch, *WITHOUT_BARRIER[missing])
    with pytest.raises(EmulatorError, match=r"race in|that no thread of its block wrote") as failed:
        decode(stages)
    assert "paged_decode_mma" in str(failed.value)


def test_without_the_checker_a_missing_syncwarp_goes_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the checker exists: the fibers' order hides the race, and the result is right."""
    monkeypatch.delenv(emulator.RACECHECK_ENV, raising=False)
    with_source(monkeypatch, *WITHOUT_BARRIER["the __syncwarp after a tile's copies"])
    try:
        actual, expected = decode(3)
    finally:
        emulator._kernel.cache_clear()
    assert_close(actual, expected, torch.bfloat16)
