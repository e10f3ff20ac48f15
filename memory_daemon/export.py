"""A pool's memory: allocated and exported by the daemon, mapped zero-copy by workers.

CPU: the pool is a file in /dev/shm, reserved with posix_fallocate so that a full /dev/shm fails at
registration and not as a SIGBUS mid-decode. Workers map it with torch.from_file(shared=True), a plain
shared mmap. Nothing here uses multiprocessing.shared_memory, whose resource_tracker unlinks a segment when
any process that attached to it exits.

CUDA: the pool is one plain cudaMalloc through CuPy's runtime API: not CuPy's memory pool, which
sub-allocates, and never managed or VMM memory, which cudaIpcGetMemHandle cannot export. The handle
carries the IPC handle of the whole base allocation, the pool's byte offset in it, and the device UUID,
since device indices differ between processes (CUDA_VISIBLE_DEVICES).

The daemon side never imports torch; the worker side (`map_pool`) does.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from memory_daemon.shape import PoolShape
from pagedserve.plumbing.errors import ResourceExhausted
from pagedserve.plumbing.sizes import format_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SHM_NAME = re.compile(r"^pagedserve-kv-(\d+)-(\d+)\.bin$")


@dataclass(frozen=True)
class ShmHandle:
    path: str  # the pool file in a tmpfs folder


@dataclass(frozen=True)
class CudaHandle:
    ipc_handle: bytes  # of the whole base allocation
    offset: int  # the pool's bytes start here in it
    device_uuid: str


@dataclass(frozen=True)
class PoolDescriptor:
    """What a worker needs to map a pool."""

    pool_id: int
    shape: PoolShape
    num_pages: int
    nbytes: int
    handle: ShmHandle | CudaHandle


class Storage(Protocol):
    label: str

    @property
    def handle(self) -> ShmHandle | CudaHandle:
        """What a worker needs to map this memory."""

    def close(self) -> None: ...


class ShmStorage:
    """A pool file in a tmpfs folder, named after the daemon's pid so a dead daemon's files can be found."""

    def __init__(self, folder: Path, pool_id: int, nbytes: int) -> None:
        self.path = folder / f"pagedserve-kv-{os.getpid()}-{pool_id}.bin"
        self.label = f"shm:{self.path}"
        self.handle = ShmHandle(str(self.path))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            self.path.unlink()
            raise ResourceExhausted(
                f"cannot reserve {format_bytes(nbytes)} in {folder}: {exc.strerror}; "
                "free space there or register a smaller pool"
            ) from exc
        finally:
            os.close(fd)

    def close(self) -> None:
        # Workers that still map the file keep its memory until they unmap; the name goes now.
        self.path.unlink(missing_ok=True)


def remove_stale_files(folder: Path) -> list[Path]:
    """Remove pool files left by daemons that died without cleaning up (SIGKILL, power loss)."""
    removed = []
    for path in folder.glob("pagedserve-kv-*.bin"):
        match = _SHM_NAME.match(path.name)
        if match and not _pid_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CudaStorage:
    """One cudaMalloc on the daemon's device, exported by CUDA IPC."""

    def __init__(self, device_index: int, nbytes: int) -> None:
        import cupy

        runtime = cupy.cuda.runtime
        self._device_index = device_index
        with cupy.cuda.Device(device_index):
            try:
                self.ptr = runtime.malloc(nbytes)
            except runtime.CUDARuntimeError as exc:
                raise ResourceExhausted(
                    f"cannot allocate {format_bytes(nbytes)} on cuda:{device_index}: {exc}; "
                    "register a smaller pool"
                ) from exc
            runtime.memset(self.ptr, 0, nbytes)
            ipc_handle = bytes(runtime.ipcGetMemHandle(self.ptr))
        uuid = cuda_device_uuid(device_index)
        self.label = f"cuda:{uuid}"
        # The pool starts at the base of its own allocation.
        self.handle = CudaHandle(ipc_handle, offset=0, device_uuid=uuid)

    def close(self) -> None:
        import cupy

        with cupy.cuda.Device(self._device_index):
            cupy.cuda.runtime.free(self.ptr)


def cuda_device_uuid(device_index: int) -> str:
    """The device's UUID as nvidia-smi prints it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    import cupy

    raw = bytes(cupy.cuda.runtime.getDeviceProperties(device_index)["uuid"]).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:32]}"


def map_pool(descriptor: PoolDescriptor) -> torch.Tensor:
    """Map an exported pool as [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim], zero-copy."""
    import torch

    shape = descriptor.shape
    dtype = getattr(torch, shape.dtype)
    dims = shape.tensor_shape(descriptor.num_pages)
    handle = descriptor.handle
    if isinstance(handle, ShmHandle):
        numel = descriptor.nbytes // shape.itemsize
        return torch.from_file(handle.path, shared=True, size=numel, dtype=dtype).view(dims)
    return _map_cuda(handle, descriptor.nbytes).view(dtype).view(dims)


def _map_cuda(ipc: CudaHandle, nbytes: int) -> torch.Tensor:
    import cupy
    import torch

    index = next(
        (i for i in range(cupy.cuda.runtime.getDeviceCount()) if cuda_device_uuid(i) == ipc.device_uuid),
        None,
    )
    if index is None:
        raise RuntimeError(
            f"the pool lives on {ipc.device_uuid}, which this process cannot see; "
            "check CUDA_VISIBLE_DEVICES and that the worker shares the daemon's IPC namespace"
        )
    with cupy.cuda.Device(index):
        # The mapping stays open for the life of the process: a worker maps its pool once.
        base = cupy.cuda.runtime.ipcOpenMemHandle(ipc.ipc_handle)
        memory = cupy.cuda.UnownedMemory(base + ipc.offset, nbytes, owner=None, device_id=index)
        raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        return torch.from_dlpack(raw)
