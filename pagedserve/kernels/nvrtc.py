"""Compiling the kernels in csrc/ with NVRTC, and caching the results.

Compilation needs no GPU: `compile_cubin` runs the raw NVRTC API, so CI checks that every kernel builds for
every architecture we tune for. Loading does: `load_kernel` picks the current device's architecture,
compiles once per (source, macros, architecture, NVRTC version) into ~/.cache/pagedserve/kernels/, and
returns a CuPy RawKernel.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.plumbing.paths import cache_dir

if TYPE_CHECKING:
    import cupy

CSRC = Path(__file__).parent / "csrc"
KERNEL_FILES = (
    "kv_write",
    "paged_decode",
    "paged_decode_mma",
    "paged_prefill",
    "paged_prefill_mma",
    "rms_norm",
    "rotary",
    "silu_and_mul",
)
DTYPE_MACROS = {"float32": "DTYPE_F32", "float16": "DTYPE_F16", "bfloat16": "DTYPE_BF16"}


class CompileError(RuntimeError):
    pass


ATTENTION = ("paged_decode", "paged_prefill")
TENSOR_CORE = ("paged_decode_mma", "paged_prefill_mma")  # 16-bit types only


def source(name: str) -> str:
    """A kernel's source with the shared headers in front (NVRTC sees one file)."""
    headers = [
        "common.cuh",
        *(["variations.cuh"] if name in (*ATTENTION, *TENSOR_CORE) else []),
        *(["attention.cuh"] if name in ATTENTION else []),
        *(["mma.cuh"] if name in TENSOR_CORE else []),
        *(["decode.cuh"] if name in ("paged_decode", "paged_decode_mma") else []),
    ]
    return "\n".join((CSRC / file).read_text() for file in [*headers, f"{name}.cu"])


def _nvrtc() -> Any:  # cupy's module of raw NVRTC bindings
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def compile_cubin(
    name: str, arch: str, macros: Mapping[str, object], *, report: bool = False
) -> tuple[bytes, str]:
    """Compile csrc/<name>.cu for arch (e.g. "sm_90") with -D macros; return the cubin and the log.

    report asks ptxas for its resource report (registers, spills) in the log. Raises CompileError.
    """
    options = ["--ptxas-options=-v"] if report else []
    return _compile(name, arch, macros, options, lambda nvrtc, program: nvrtc.getCUBIN(program))


def compile_ptx(name: str, arch: str, macros: Mapping[str, object]) -> str:
    """The PTX of csrc/<name>.cu for arch: what the kernels' loads and stores compile to, read with no GPU."""
    ptx, _ = _compile(name, arch, macros, [], lambda nvrtc, program: nvrtc.getPTX(program))
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def _compile(
    name: str, arch: str, macros: Mapping[str, object], extra: list[str], result: Any
) -> tuple[Any, str]:
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(source(name), f"{name}.cu", [], [])
    options = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *extra]
    options += [f"-D{key}={value}" for key, value in sorted(macros.items())]
    try:
        nvrtc.compileProgram(program, options)
        return result(nvrtc, program), nvrtc.getProgramLog(program)
    except nvrtc.NVRTCError as exc:
        log = nvrtc.getProgramLog(program)
        raise CompileError(f"{name}.cu for {arch} with {dict(macros)}: {exc}\n{log}") from None
    finally:
        nvrtc.destroyProgram(program)


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


@functools.cache
def _arch(device: int) -> str:
    import cupy

    return f"sm_{cupy.cuda.Device(device).compute_capability}"


def load_kernel(name: str, function: str, macros: tuple[tuple[str, object], ...]) -> cupy.RawKernel:
    """The kernel `function` of csrc/<name>.cu, built for the current device with the given macros."""
    import cupy

    return _load_kernel(name, function, macros, _arch(cupy.cuda.runtime.getDevice()))


@functools.cache
def _load_kernel(
    name: str, function: str, macros: tuple[tuple[str, object], ...], arch: str
) -> cupy.RawKernel:
    import cupy

    version = ".".join(map(str, nvrtc_version()))
    key = hashlib.sha256(f"{source(name)}|{macros}|{arch}|{version}".encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{name}-{arch}-{key}.cubin"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{key}.tmp")
        scratch.write_bytes(compile_cubin(name, arch, dict(macros))[0])
        scratch.rename(path)  # atomic: a concurrent worker sees a whole file or none
    return cupy.RawModule(path=str(path)).get_function(function)
