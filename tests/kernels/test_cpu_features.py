"""Which bfloat16 instructions the worker relies on is found by running them, in a child process, not by
reading the CPU's flags: a feature that faults there (SIGILL) or is refused is not used, and `--dtype auto`
falls back to float32, saying why. On a CPU that lacks a feature, forcing its probe runs the real
instruction, which must fault in the child and leave this process running."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels import cpu_features
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops
from pagedserve.kernels.cpu_features import FEATURES, advertised, probe
from services.worker.config import WorkerConfig
from services.worker.server import model_dtype

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")


@pytest.fixture(scope="module")
def backend() -> CpuBackend:
    ops = cpu_ops()
    assert ops is not None, "a compiler is here, so the C++ ops must build"
    return CpuBackend(ops)


@pytest.mark.parametrize("name", FEATURES)
def test_a_feature_is_usable_only_where_its_probe_ran_it(backend: CpuBackend, name: str) -> None:
    found = probe(name)
    if name not in advertised():  # the instruction is not there, or the kernel refuses its state
        assert not found.usable
        expected = "AMX's tile state" if name.startswith("amx") else "raised SIGILL"
        assert expected in found.why, found.why
    else:  # advertised: it runs, or the reason it does not is said, and it is the CPU's, not our GEMM's
        assert found.usable or "is advertised, but" in found.why, found.why
        assert not found.our_defect, found.why


def test_auto_falls_back_to_float32_when_an_advertised_feature_faults(
    backend: CpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every feature claimed, as a hypervisor may claim what it does not pass through: those this CPU lacks
    fault in their probes, and auto picks what the rest allow."""
    monkeypatch.setattr(cpu_features, "advertised", lambda: set(FEATURES))
    cpu_features.cpu_features.cache_clear()
    try:
        found = cpu_features.cpu_features()
        dtype, why = model_dtype(WorkerConfig(device="cpu"), backend)
    finally:
        cpu_features.cpu_features.cache_clear()
    assert dtype == (torch.bfloat16 if found.native_bf16 else torch.float32)
    for feature in (found.avx512_bf16, found.amx_bf16):
        assert feature.why in why
        if feature.name not in advertised():
            assert not feature.usable


def test_a_dtype_given_is_taken_as_it_is(backend: CpuBackend) -> None:
    assert model_dtype(WorkerConfig(device="cpu", dtype="bfloat16"), backend) == (
        torch.bfloat16,
        "bfloat16, as --dtype says",
    )
    dtype, why = model_dtype(WorkerConfig(device="cpu"), backend)
    assert (dtype == torch.bfloat16) == cpu_features.cpu_features().native_bf16
    assert why.startswith(str(dtype).removeprefix("torch."))


ONEDNN_GEMM = """
import torch
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops
from pagedserve.kernels.cpu_features import cpu_features
backend = CpuBackend(cpu_ops(), cpu_features())
x, w = torch.randn(64, 576).bfloat16(), torch.randn(1536, 576).bfloat16()
out = backend.linear(x, w)
torch.testing.assert_close(out.float(), (x.float() @ w.float().T), rtol=2**-7, atol=0.2)
"""


def test_a_bfloat16_gemm_of_many_rows_runs_where_the_cpu_has_bfloat16_arithmetic() -> None:
    """Past the few-row GEMM, a bfloat16 product goes to torch's F.linear only where the CPU multiplies
    bfloat16 in hardware, and there oneDNN's own log (ONEDNN_VERBOSE) must show a bfloat16 matmul of the
    instruction set probed; elsewhere it is widened to float32 (MKL), and oneDNN runs no bfloat16 matmul."""
    done = subprocess.run(
        [sys.executable, "-c", ONEDNN_GEMM],
        env={**os.environ, "ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    matmuls = [line for line in done.stdout.splitlines() if ",exec," in line and ",matmul," in line]
    found = cpu_features.cpu_features()
    if found.native_bf16:
        isa = "amx" if found.amx_bf16.usable else "avx512_core_bf16"
        assert any(isa in line and "src:bf16" in line for line in matmuls), done.stdout[-2000:]
    else:
        assert not any("src:bf16" in line for line in matmuls), done.stdout[-2000:]
