"""Where a kernel of csrc/ runs: on a CUDA device through CuPy, on torch's current stream, so that it orders
with torch's own work and can be captured in CUDA graphs; on the CPU in the emulator (kernels/emulator.py).
And how many of its blocks the device holds at once, which sizes grids that must fill it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.emulator import emulated_kernel
from kernels.nvrtc import load_kernel

# The emulator's stand-in for a device's resident decode blocks: 4 SMs of 2 blocks each, few, so that tests
# with a handful of sequences meet both a split context and a batch that fills the device alone.
EMULATED_RESIDENT_BLOCKS = 8


@functools.cache
def _external_stream(device: int, pointer: int) -> Any:  # a cupy.cuda.ExternalStream
    import cupy

    return cupy.cuda.ExternalStream(pointer, device)


def launch(
    name: str,
    function: str,
    macros: dict[str, int],
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple,
    device: torch.device,
) -> None:
    """Runs `function` of csrc/<name>.cu, compiled with macros (DTYPE_* among them): on a CUDA device through
    CuPy, on torch's current stream; on the CPU in the emulator."""
    key = tuple(sorted(macros.items()))
    if device.type != "cuda":
        emulated_kernel(name, function, key)(grid, block, args)
        return
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), _external_stream(device.index, stream.cuda_stream):
        load_kernel(name, function, key)(grid, block, args)


def resident_blocks(
    name: str, function: str, macros: dict[str, int], threads: int, device: torch.device
) -> int:
    """How many blocks of this kernel the device holds at once, all its SMs together."""
    if device.type != "cuda":
        return EMULATED_RESIDENT_BLOCKS
    return _occupancy(device.index, name, function, tuple(sorted(macros.items())), threads)


@functools.cache
def _occupancy(index: int, name: str, function: str, key: tuple[tuple[str, int], ...], threads: int) -> int:
    import cupy
    from cupy_backends.cuda.api import driver

    with cupy.cuda.Device(index):
        kernel = load_kernel(name, function, key)
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, 0)
    return int(per_sm) * torch.cuda.get_device_properties(index).multi_processor_count
