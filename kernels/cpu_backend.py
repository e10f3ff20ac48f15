"""The CPU backend: the torch reference, with decode attention in C++ that reads the pool's pages in place.

The torch reference gathers every decoding sequence's pages into a copy, every layer, every step, and
zeroes the stale tail of each last page so that a masked softmax cannot meet a NaN; on a CPU that costs
more than the attention itself. `kernels/cpu/paged_decode.cpp` reads each K and V row where it lies, only
up to the sequence's length. It is built once per machine by torch's cpp_extension, for this CPU's
instruction set (-march=native), into the cache folder; where it cannot be built (no compiler), the worker
runs the torch reference and says why. Prefill chunks, other dtypes and CUDA tensors take the reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

from kernels.backend import AttentionMetadata
from kernels.torch_ref import TorchBackend
from pagedserve.plumbing.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "paged_decode.cpp"


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled C++ ops, built on first use; None, with a warning, when they cannot be built."""
    from torch.utils import cpp_extension

    # The build is for this CPU and this torch: its name keys both, so a shared cache never mixes them.
    key = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode() + torch.__version__.encode()).hexdigest()
    name = f"pagedserve_cpu_{key[:12]}"
    folder = cache_dir() / "cpu-kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    try:
        return cpp_extension.load(
            name,
            [str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            build_directory=str(folder),
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, or no ninja
        log.warning("the C++ CPU kernels could not be built (%s); running the torch reference", exc)
        return None


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

    def _decode_all(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if q.is_cuda or q.dtype != torch.float32:
            return super()._decode_all(q, kv_layer, meta, scale)
        n = q.shape[0]
        return self._ops.paged_decode(
            q.contiguous(), kv_layer, meta.block_tables[:n], meta.seq_lens[:n], scale
        )
