"""Where a kernel of csrc/ runs: on a CUDA device through CuPy, on torch's current stream, so that it orders
with torch's own work and can be captured in CUDA graphs; on the CPU in the emulator
(pagedserve/kernels/emulator.py). And how many of its blocks the device holds at once, which sizes grids that
must fill it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pagedserve.kernels.emulator import emulated_kernel
from pagedserve.kernels.nvrtc import load_kernel

# The emulator's stand-in for a device's resident decode blocks: 4 SMs of 2 blocks each, few, so that tests
# with a handful of sequences meet both a split context and a batch that fills the device alone.
EMULATED_RESIDENT_BLOCKS = 8
# ... and for the dynamic shared memory a block may opt into: a Hopper's (227 KiB).
EMULATED_MAX_SHARED = 227 * 1024


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
    shared_mem: int = 0,
) -> None:
    """Runs `function` of csrc/<name>.cu, compiled with macros (DTYPE_* among them), with shared_mem bytes of
    dynamic shared memory: on a CUDA device through CuPy, on torch's current stream; on the CPU in the
    emulator."""
    key = tuple(sorted(macros.items()))
    if device.type != "cuda":
        emulated_kernel(name, function, key)(grid, block, args, shared_mem)
        return
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), _external_stream(device.index, stream.cuda_stream):
        kernel = _with_shared(load_kernel(name, function, key), shared_mem, device.index)
        kernel(grid, block, args, shared_mem=shared_mem)


@functools.cache
def _with_shared(kernel: Any, shared_mem: int, index: int) -> Any:  # a cupy.RawKernel
    """The kernel, allowed shared_mem bytes of dynamic shared memory on device index (the current one): past
    48 KiB, CUDA asks for it, device by device."""
    if shared_mem > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    return kernel


def max_shared_bytes(device: torch.device) -> int:
    """The most dynamic shared memory one block may have on this device (CUDA's opt-in limit)."""
    if device.type != "cuda":
        return EMULATED_MAX_SHARED
    return _max_shared(device.index)


@functools.cache
def _max_shared(index: int) -> int:
    from cupy_backends.cuda.api import runtime

    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, index))


def resident_blocks(
    name: str, function: str, macros: dict[str, int], threads: int, device: torch.device, shared_mem: int = 0
) -> int:
    """How many blocks of this kernel the device holds at once, all its SMs together."""
    if device.type != "cuda":
        return EMULATED_RESIDENT_BLOCKS
    return _occupancy(device.index, name, function, tuple(sorted(macros.items())), threads, shared_mem)


@functools.cache
def _occupancy(
    index: int, name: str, function: str, key: tuple[tuple[str, int], ...], threads: int, shared_mem: int
) -> int:
    import cupy
    from cupy_backends.cuda.api import driver

    with cupy.cuda.Device(index):
        kernel = _with_shared(load_kernel(name, function, key), shared_mem, index)
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, shared_mem)
    return int(per_sm) * torch.cuda.get_device_properties(index).multi_processor_count
