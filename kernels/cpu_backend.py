"""The CPU backend: the torch reference, with decode attention and the elementwise steps in C++.

The torch reference gathers every decoding sequence's pages into a copy, every layer, every step, and
zeroes the stale tail of each last page so that a masked softmax cannot meet a NaN; on a CPU that costs
more than the attention itself. `kernels/cpu/paged_decode.cpp` reads each K and V row where it lies, only
up to the sequence's length. `kernels/cpu/elementwise.cpp` does RMSNorm (with the residual add), rotary and
the SiLU gate in one pass each, where torch makes a temporary for every operator.

The ops are built once per machine by torch's cpp_extension, for this CPU's instruction set, into the cache
folder; where they cannot be built (no compiler), the worker runs the torch reference and says why. Prefill
attention, other dtypes and CUDA tensors take the reference.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from kernels.backend import AttentionMetadata
from kernels.torch_ref import TorchBackend
from pagedserve.plumbing.paths import cache_dir

log = logging.getLogger(__name__)

# Up to this many rows, a GEMM reads its weight faster through skinny_linear than through MKL, which is
# slower at 2-16 rows than at 1 (scripts/bench_cpu_ops.py measures both).
SKINNY_ROWS = 16

SOURCES = [
    Path(__file__).parent / "cpu" / name
    for name in ("paged_decode.cpp", "elementwise.cpp", "skinny_linear.cpp", "bindings.cpp")
]
# For this CPU's vector units; -ffast-math vectorizes exp and the reductions (the kernels read only slots
# that hold written, finite values). at::parallel_for is OpenMP inlined from torch's headers: without
# -fopenmp it runs on one thread. The library it links is libgomp.so.1, the one torch has loaded already.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled C++ ops, built on first use; None, with a warning, when they cannot be built."""
    from torch.utils import cpp_extension

    # The build is for this CPU and this torch: its name keys both, so a shared cache never mixes them.
    key = hashlib.sha256(
        b"".join(source.read_bytes() for source in SOURCES)
        + _cpu_flags().encode()
        + str(CFLAGS).encode()
        + torch.__version__.encode()
    ).hexdigest()
    name = f"pagedserve_cpu_{key[:12]}"
    folder = cache_dir() / "cpu-kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    try:
        with _build_lock(folder):
            return cpp_extension.load(
                name,
                [str(source) for source in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
            )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, or no ninja
        log.warning("the C++ CPU kernels could not be built (%s); running the torch reference", exc)
        return None


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Holds an flock beside the build folder. cpp_extension's own lock is a file that a process killed
    mid-build leaves behind, and every later load waits on it forever; the kernel drops an flock with its
    holder, and whoever holds it knows that a `lock` file still in the folder is such a leftover."""
    with open(folder.parent / f"{folder.name}.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        yield


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; pip's ninja (a dependency) lies beside this interpreter, which a
    virtual environment used without activating it leaves off PATH."""
    here = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if here not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join((here, path)) if path else here


def _cpu_flags() -> str:
    try:
        return next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return platform.processor()


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, ops: ModuleType) -> None:
        super().__init__()
        self._ops = ops

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _ours(x):
            return super().rms_norm(x, weight, eps, residual)
        return self._ops.rms_norm(x, weight, eps, residual)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _ours(q):
            return super().rotary(q, k, positions, cos_sin)
        return self._ops.rotary(q, k, positions, cos_sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not _ours(x):
            return super().silu_and_mul(x)
        return self._ops.silu_and_mul(x)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > SKINNY_ROWS or not _ours(x):
            return super().linear(x, weight, bias)
        return self._ops.skinny_linear(x, weight, bias)

    def _decode_all(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if not _ours(q):
            return super()._decode_all(q, kv_layer, meta, scale)
        n = q.shape[0]
        return self._ops.paged_decode(
            q.contiguous(), kv_layer, meta.block_tables[:n], meta.seq_lens[:n], scale
        )


def _ours(x: torch.Tensor) -> bool:
    """The C++ ops take float32 CPU tensors; the reference takes the rest."""
    return x.device.type == "cpu" and x.dtype == torch.float32
