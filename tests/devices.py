"""What this machine can run the CUDA kernels on: a GPU with CuPy, else the emulator on the CPU."""

from __future__ import annotations

import functools
import importlib.util

import torch

from pagedserve.kernels.emulator import compiler


@functools.cache
def missing_for_gpu_tests() -> str | None:
    """Why this machine cannot run the `gpu` tests, or None when it can."""
    missing = [
        *(["no CUDA device"] if not torch.cuda.is_available() else []),
        *(["no CuPy"] if importlib.util.find_spec("cupy") is None else []),
    ]
    return f"needs a CUDA device and CuPy: this machine has {' and '.join(missing)}" if missing else None


def kernel_device() -> torch.device:
    """Where the `cuda_kernels` tests run the kernels: the GPU, or the CPU in their emulator."""
    return torch.device("cuda" if missing_for_gpu_tests() is None else "cpu")


def missing_for_kernel_tests() -> str | None:
    if missing_for_gpu_tests() is None or compiler() is not None:
        return None
    return f"{missing_for_gpu_tests()}, and no C++ compiler for the kernels' emulator"
