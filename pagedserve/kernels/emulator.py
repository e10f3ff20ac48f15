"""The CUDA kernels of csrc/ on the CPU, for checking them against the torch reference where no GPU is
(as Triton's interpreter does for Triton kernels).

The same sources NVRTC compiles are compiled by the host's C++ compiler with csrc/emulate.h in front, which
runs each CUDA thread as a fiber and each warp shuffle and barrier as a meeting of fibers. cuda_ops
launches here when its tensors are on the CPU, with the same arguments it gives CuPy. It is slow (a few
thousand threads a millisecond) and says nothing about speed.

With PAGEDSERVE_EMULATE_RACECHECK=1 the kernels are built with every memory access instrumented, and a launch
fails on a shared-memory race, an uninitialised shared read, or a cp.async target read too early (the
checker is in csrc/emulate.h). The hooks are emulate.h's own: the library is compiled with -fsanitize=thread
but linked without ThreadSanitizer's runtime, so it loads into any Python.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pagedserve.kernels.nvrtc import CSRC, source
from pagedserve.plumbing.paths import cache_dir

# The host compiler's flags: no strict aliasing, as NVRTC's sources read 16-bit types through other
# types' pointers; no _FORTIFY_SOURCE, whose longjmp check refuses the jump between fiber stacks; hidden
# symbols but the entry points (emulate.h's EMULATE_ENTRY).
CXXFLAGS = [
    "-std=c++20",
    "-O1",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",
    "-U_FORTIFY_SOURCE",
    "-w",
]
RACECHECK_FLAGS = [
    "-fsanitize=thread",
    "--param",
    "tsan-instrument-func-entry-exit=0",
    "-DPAGEDSERVE_RACECHECK=1",
]
RACECHECK_ENV = "PAGEDSERVE_EMULATE_RACECHECK"
_KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(')
_ARGUMENT_TYPES: dict[type, type[ctypes._SimpleCData]] = {
    np.uint64: ctypes.c_uint64,  # a device pointer
    np.int64: ctypes.c_int64,
    np.int32: ctypes.c_int32,
    np.float32: ctypes.c_float,
}


class EmulatorError(RuntimeError):
    pass


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++")


class EmulatedKernel:
    """A kernel of csrc/ that runs on the CPU; called as a cupy.RawKernel is: (grid, block, args)."""

    def __init__(self, library: ctypes.CDLL, function: str) -> None:
        self.function = function
        self._entry = getattr(library, f"emulate_{function}")
        self._entry.restype = ctypes.c_int

    def __call__(
        self, grid: Sequence[int], block: Sequence[int], args: Sequence[object], shared_mem: int = 0
    ) -> None:
        values = [_argument(arg) for arg in args]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(value) for value in values])
        sizes = (ctypes.c_int64 * len(values))(*[ctypes.sizeof(value) for value in values])
        error = ctypes.create_string_buffer(512)
        dims = [*(_dims(grid)), *(_dims(block))]
        launch = (*map(ctypes.c_uint, dims), ctypes.c_int64(shared_mem), pointers, sizes, len(values), error)
        if self._entry(*launch):
            raise EmulatorError(f"{self.function}: {error.value.decode()}")


def _dims(dims: Sequence[int]) -> list[int]:
    return [*dims, 1, 1][:3]


def _argument(arg: object) -> ctypes._SimpleCData:
    """A kernel argument as cuda_ops packs it for CuPy (a NumPy scalar), as the C type of its size."""
    kind = _ARGUMENT_TYPES.get(type(arg))
    if kind is None or not isinstance(arg, np.generic):
        raise TypeError(f"a kernel argument must be one of {list(_ARGUMENT_TYPES)}, got {type(arg)}")
    return kind(arg.item())


def racecheck() -> bool:
    return os.environ.get(RACECHECK_ENV, "") not in ("", "0")


def emulated_kernel(name: str, function: str, macros: tuple[tuple[str, object], ...]) -> EmulatedKernel:
    """The kernel `function` of csrc/<name>.cu, built for the CPU with the given macros (and the race
    checker, under PAGEDSERVE_EMULATE_RACECHECK=1)."""
    return _kernel(name, function, macros, racecheck())


@functools.cache
def _kernel(
    name: str, function: str, macros: tuple[tuple[str, object], ...], checked: bool
) -> EmulatedKernel:
    return EmulatedKernel(_library(source(name), name, macros, checked), function)


@functools.cache
def _library(text: str, name: str, macros: tuple[tuple[str, object], ...], checked: bool) -> ctypes.CDLL:
    cxx = compiler()
    if cxx is None:
        raise EmulatorError("no C++ compiler (c++ or $CXX) to build the emulated kernels")
    entries = "".join(f"EMULATE_ENTRY({function})\n" for function in _KERNEL.findall(text))
    program = f'#include "emulate.h"\n{text}\n{entries}'
    flags = [*CXXFLAGS, *(RACECHECK_FLAGS if checked else [])]
    defines = [f"-D{key}={value}" for key, value in macros]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    emulate_h = (CSRC / "emulate.h").read_text()
    key = hashlib.sha256(f"{program}|{emulate_h}|{defines}|{flags}|{version}".encode()).hexdigest()[:16]
    path = cache_dir() / "emulated-kernels" / f"{name}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        # Compiled, then linked apart: -fsanitize=thread would link ThreadSanitizer's runtime too.
        objects = scratch.with_suffix(".o")
        standard = ["-include", str(_standard_headers(cxx, emulate_h, flags, version))]
        compile_ = [cxx, *flags, *standard, f"-I{CSRC}", *defines, "-c", "-x", "c++", "-", "-o", str(objects)]
        failure = f"{name}.cu with {dict(macros)} did not build for the CPU"
        try:
            _run(compile_, program, failure)
            _run([cxx, "-shared", str(objects), "-o", str(scratch)], None, failure)
        finally:
            objects.unlink(missing_ok=True)
        scratch.rename(path)  # atomic: a concurrent test sees a whole file or none
    return ctypes.CDLL(str(path))


def _standard_headers(cxx: str, emulate_h: str, flags: list[str], version: str) -> Path:
    """A header of emulate.h's standard includes, precompiled beside it for these flags: parsing them was
    1.1 s of each kernel's 1.9 s compile. Were the precompiled form unusable, the compiler reads the text."""
    includes = "".join(line + "\n" for line in emulate_h.splitlines() if line.startswith("#include <"))
    key = hashlib.sha256(f"{includes}|{flags}|{version}".encode()).hexdigest()[:16]
    header = cache_dir() / "emulated-kernels" / f"standard-{key}" / "standard.h"
    precompiled = header.with_suffix(".h.gch")
    if not precompiled.exists():
        header.parent.mkdir(parents=True, exist_ok=True)
        text = header.with_suffix(f".{os.getpid()}.h")
        text.write_text(includes)
        text.rename(header)  # each file whole, by a rename: another test process may be compiling with it
        scratch = header.with_suffix(f".{os.getpid()}.tmp")
        _run([cxx, *flags, "-x", "c++-header", str(header), "-o", str(scratch)], None, "emulate.h's includes")
        scratch.rename(precompiled)
    return header


def _run(command: list[str], stdin: str | None, failure: str) -> None:
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise EmulatorError(f"{failure}:\n{done.stderr}")
