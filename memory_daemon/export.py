"""A pool's memory: allocated and exported by the daemon, mapped zero-copy by workers.

CPU: the pool is a file in /dev/shm, reserved with posix_fallocate so that a full /dev/shm fails at
registration and not as a SIGBUS mid-decode. Every user can make files in /dev/shm, so a pool file's name
holds 128 random bits beside the daemon's pid: another user who could plant a file under a name they can
guess would stop the daemon from making its pool. Workers map it with a plain shared mmap. Nothing here uses
multiprocessing.shared_memory, whose resource_tracker unlinks a segment when any process that attached to
it exits. A worker trusts the path the daemon sends no further than it can check (`open_pool_file`): a pool
file lies under the worker's --shm-dir, has a pool file's name, is a regular file (never followed through a
symlink) with one link, belongs to the worker's own user (the daemon runs as that user), has mode 0600,
and has exactly the descriptor's size. Anything else is refused before a byte is mapped, and a worker never
resizes the file.

CUDA: the pool is one plain cudaMalloc through CuPy's runtime API: not CuPy's memory pool, which
sub-allocates, and never managed or VMM memory, which cudaIpcGetMemHandle cannot export. The handle
carries the IPC handle of the whole base allocation, the pool's byte offset in it, and the device UUID,
since device indices differ between processes (CUDA_VISIBLE_DEVICES).

The daemon side never imports torch; the worker side (`map_pool`) does.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from memory_daemon.shape import PoolShape
from pagedserve.plumbing.errors import PermissionDenied, ResourceExhausted
from pagedserve.plumbing.sizes import format_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SHM_NAME = re.compile(r"^pagedserve-kv-\d+-\d+-[0-9a-f]{32}\.bin$")
# remove_stale_files also takes the names daemons gave their files before the random token.
_STALE_NAME = re.compile(r"^pagedserve-kv-(\d+)-\d+(?:-[0-9a-f]{32})?\.bin$")
_NAME_TRIES = 4  # fresh names tried before giving up: a chance collision of 128 bits never happens
SHM_DIR = "/dev/shm"  # where CPU pools live unless --shm-dir says otherwise


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
    """A pool file in a tmpfs folder: pagedserve-kv-PID-ID-TOKEN.bin, with the daemon's pid so that a dead
    daemon's files can be found, and a random token so that no other user can take the name first."""

    def __init__(self, folder: Path, pool_id: int, nbytes: int) -> None:
        fd, self.path = _create_pool_file(folder, pool_id)
        self.label = f"shm:{self.path}"
        self.handle = ShmHandle(str(self.path))
        try:
            os.posix_fallocate(fd, 0, nbytes)
            # The daemon's own view, for the pages it moves between the pool and a lower tier.
            self.memory = mmap.mmap(fd, nbytes)
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
        self.memory.close()
        self.path.unlink(missing_ok=True)


def _create_pool_file(folder: Path, pool_id: int) -> tuple[int, Path]:
    """A new file of this user's only (mode 0600) under a fresh name, never one that was there before."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_NAME_TRIES):
        path = folder / f"pagedserve-kv-{os.getpid()}-{pool_id}-{secrets.token_hex(16)}.bin"
        try:
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            log.warning("%s is taken already; trying another name", path)
    raise PermissionDenied(
        f"cannot make a pool file in {folder}: the {_NAME_TRIES} random names tried were all taken, which "
        "chance alone does not do; see who else writes there, or give the daemon a --shm-dir of its own"
    )


def remove_stale_files(folder: Path) -> list[Path]:
    """Remove pool files left by daemons that died without cleaning up (SIGKILL, power loss)."""
    removed = []
    for path in folder.glob("pagedserve-kv-*.bin"):
        match = _STALE_NAME.match(path.name)
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if info.st_uid != os.geteuid() or not stat.S_ISREG(info.st_mode):
            continue  # another user's, or not a pool file at all: not ours to remove
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


def map_pool(descriptor: PoolDescriptor, shm_dir: str | Path = SHM_DIR) -> torch.Tensor:
    """Map an exported pool as [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim], zero-copy.

    A CPU pool's file must lie under shm_dir; PermissionDenied names what is wrong with one that does not
    pass `open_pool_file`'s checks.
    """
    import torch

    shape = descriptor.shape
    dtype = getattr(torch, shape.dtype)
    dims = shape.tensor_shape(descriptor.num_pages)
    handle = descriptor.handle
    if descriptor.num_pages < 1 or descriptor.nbytes != descriptor.num_pages * shape.page_bytes:
        raise PermissionDenied(
            f"refusing the pool: {descriptor.num_pages} pages of {shape} are not {descriptor.nbytes} bytes"
        )
    if isinstance(handle, ShmHandle):
        mapped = open_pool_file(handle.path, descriptor.nbytes, shm_dir)
        return torch.frombuffer(mapped, dtype=dtype).view(dims)
    return _map_cuda(handle, descriptor.nbytes).view(dtype).view(dims)


def open_pool_file(path: str, nbytes: int, shm_dir: str | Path = SHM_DIR) -> mmap.mmap:
    """A shared, writable mapping of exactly nbytes of the pool file at path, once it passed every check."""
    why = f"refusing the pool file {path}"
    folder, name = os.path.split(path)
    root = os.path.realpath(shm_dir)
    real_folder = os.path.realpath(folder or ".")
    if not os.path.isabs(path) or os.path.commonpath([root, real_folder]) != root:
        raise PermissionDenied(f"{why}: it is not under {shm_dir} (--shm-dir), where pools live")
    if not _SHM_NAME.match(name):
        raise PermissionDenied(f"{why}: a pool file's name is pagedserve-kv-PID-ID-TOKEN.bin")
    dir_fd = os.open(real_folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        raise PermissionDenied(f"{why}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)
    try:
        problem = _pool_file_problem(os.fstat(fd), nbytes)
        if problem is not None:
            raise PermissionDenied(f"{why}: {problem}")
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _pool_file_problem(info: os.stat_result, nbytes: int) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_nlink != 1:
        return f"it has {info.st_nlink} names (hard links); a pool file has one"
    if info.st_uid != os.geteuid():
        return f"it belongs to uid {info.st_uid}; the daemon and its workers run as one user ({os.geteuid()})"
    if stat.S_IMODE(info.st_mode) != 0o600:
        return f"its mode is {stat.S_IMODE(info.st_mode):o}, not 600"
    if info.st_size != nbytes:
        return f"it holds {info.st_size} bytes, not the pool's {nbytes}"
    return None


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
