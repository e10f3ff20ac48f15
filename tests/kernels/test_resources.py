"""pagedserve/kernels/resources.py against two readings of the same cubins that share none of its code: the
report ptxas writes while it builds them (`-v`), and `cuobjdump --dump-resource-usage` where a CUDA toolkit
has it.

The cubins come from NVRTC (cupy's bindings; pip's NVRTC 12 writes ELF ABI 7) and, where it is installed,
nvcc (CUDA 13 writes ABI 8, the format of NVRTC 13 on a GPU machine). Each compiler builds the attention
kernels of csrc/ at their smallest and largest register footprints, a row-wise kernel with a barrier and
shared memory, and a probe whose kernels spill under a register cap and keep an array on the stack, so
that the reader is checked on frames that are not 0 as well. Every compile is fresh: a macro that nothing
reads, new each run, keeps NVRTC 13 from serving it from its cache without a report.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import struct
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedserve.kernels.nvrtc import ATTENTION, source
from pagedserve.kernels.resources import CubinError, Format, Record, parse_records, read_resources

PROBE = r"""
extern "C" __global__ void spills(float* a, int n) {  // 48 live values under a cap of 32 registers
    float x[48];
#pragma unroll
    for (int i = 0; i < 48; i++) x[i] = a[i * n + threadIdx.x];
    float s = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; r++) {
#pragma unroll
        for (int i = 0; i < 48; i++) s += x[i] * x[(i + r) % 48];
    }
#pragma unroll
    for (int i = 0; i < 48; i++) a[i * n] = x[i] * s;
}

extern "C" __global__ void stack_array(float* a) {  // indexed at run time: on the stack, not spilled
    float x[256];
    for (int i = 0; i < 256; i++) x[i] = a[i * threadIdx.x];
    a[threadIdx.x] = x[(int)a[3] & 255];
}

extern "C" __global__ void __launch_bounds__(128) barrier_and_shared(float* a) {
    __shared__ float s[100];
    s[threadIdx.x % 100] = a[0];
    __syncthreads();
    a[threadIdx.x] = s[(threadIdx.x + 1) % 100];
}
"""
PROBE_CAP = 32  # registers


@dataclass(frozen=True)
class Variant:
    label: str
    code: str
    arch: str
    macros: dict[str, object]
    options: tuple[str, ...] = ()  # options both compilers take


def variants() -> list[Variant]:
    found = []
    for arch, name, group in itertools.product(("sm_80", "sm_90"), ATTENTION, (1, 16)):
        macros = {"DTYPE_BF16": 1, "HEAD_DIM": 128, "PAGE_SIZE": 16, "GROUP": group, "NUM_WARPS": 4}
        found.append(Variant(f"{name}-{arch}-group{group}", source(name), arch, macros))
    tensor_cores = {"paged_decode_mma": {"STAGES": 3, "MAX_PARTITION": 8192}, "paged_prefill_mma": {}}
    for name, extra in tensor_cores.items():
        macros = {"DTYPE_BF16": 1, "HEAD_DIM": 128, "PAGE_SIZE": 16, "GROUP": 8, "NUM_WARPS": 4, **extra}
        found.append(Variant(f"{name}-sm_90-group8", source(name), "sm_90", macros))
    rms_norm = {"DTYPE_F16": 1, "VEC": 8, "ITEMS": 2}
    found.append(Variant("rms_norm-sm_90", source("rms_norm"), "sm_90", rms_norm))
    found.append(Variant("probe-sm_90", PROBE, "sm_90", {}, (f"--maxrregcount={PROBE_CAP}",)))
    return found


@dataclass(frozen=True)
class Build:
    label: str  # compiler and variant
    cubin: bytes
    log: str  # ptxas's report


def nvrtc_builds() -> list[Build]:
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs cupy and nvidia-cuda-nvrtc-cu12")
    from cupy_backends.cuda.libs import nvrtc

    version = ".".join(map(str, nvrtc.getVersion()))
    builds = []
    for variant in variants():
        program = nvrtc.createProgram(variant.code, f"{variant.label}.cu", [], [])
        options = [f"--gpu-architecture={variant.arch}", "--std=c++17", "-default-device", *variant.options]
        macros = {**variant.macros, "RESOURCES_TEST_FRESH": uuid.uuid4().int % 2**31}
        options += [f"-D{key}={value}" for key, value in sorted(macros.items())]
        options.append("--ptxas-options=-v")
        try:
            nvrtc.compileProgram(program, options)
            cubin, log = nvrtc.getCUBIN(program), nvrtc.getProgramLog(program)
            builds.append(Build(f"nvrtc-{version}-{variant.label}", cubin, log))
        finally:
            nvrtc.destroyProgram(program)
    return builds


def cuda_tool(name: str) -> str | None:
    """A CUDA tool: $NAME (upper case), PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, pip's nvidia-* wheels."""
    candidates = [os.environ.get(name.upper()), shutil.which(name)]
    homes = [home for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if home]
    candidates += [str(Path(home) / "bin" / name) for home in homes]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(map(str, Path(root).glob(f"*/bin/{name}")))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def nvcc_builds(scratch: Path) -> list[Build]:
    nvcc = cuda_tool("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    builds = []
    for variant in variants():
        code, cubin = scratch / f"{variant.label}.cu", scratch / f"{variant.label}.cubin"
        code.write_text(variant.code)
        command = [nvcc, "-cubin", f"-arch={variant.arch}", "--std=c++17", *variant.options]
        command += [f"-D{key}={value}" for key, value in sorted(variant.macros.items())]
        command += ["-Xptxas", "-v", "-o", str(cubin), str(code)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        builds.append(Build(f"nvcc-{variant.label}", cubin.read_bytes(), done.stdout + done.stderr))
    return builds


@pytest.fixture(scope="module", params=["nvrtc", "nvcc"])
def builds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Build]]:
    if request.param == "nvrtc":
        yield nvrtc_builds()
    else:
        yield nvcc_builds(tmp_path_factory.mktemp("nvcc"))


@dataclass
class Reported:
    """ptxas's report on one function."""

    frame: int
    spill_stores: int
    spill_loads: int
    registers: int | None = None  # entry functions only
    barriers: int | None = None


FRAME_LINE = r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"


def ptxas_report(log: str) -> tuple[list[str], dict[str, Reported]]:
    """The entry functions ptxas compiled, and what it reports for each function."""
    entries = re.findall(r"Compiling entry function '([^']+)'", log)
    functions: dict[str, Reported] = {}
    current = None
    for line in log.splitlines():
        if found := re.search(r"Function properties for (\S+)", line):
            current = found[1]
        elif found := re.search(FRAME_LINE, line):
            assert current is not None, log
            functions[current] = Reported(*map(int, found.groups()))
        elif found := re.search(r"Used (\d+) registers(?:, used (\d+) barriers)?", line):
            assert current in functions, log
            functions[current].registers = int(found[1])
            functions[current].barriers = None if found[2] is None else int(found[2])
    return entries, functions


def test_every_function_matches_the_ptxas_report(builds: list[Build]) -> None:
    for build in builds:
        entries, reported = ptxas_report(build.log)
        assert entries, f"{build.label}: no ptxas report, the compile was not fresh:\n{build.log}"
        read = read_resources(build.cubin)
        assert {name for name, usage in read.items() if usage.kernel} == set(entries), build.label
        for name in entries:
            got, want = read[name], reported[name]
            assert (got.registers, got.frame_size) == (want.registers, want.frame), (build.label, name, want)
            if want.barriers is not None:
                assert got.barriers == want.barriers, (build.label, name, want)
            # Nothing here calls a function with a frame: the stack the kernel needs is its own frame.
            assert got.min_stack_size in (None, got.frame_size), (build.label, name)
        for name in set(reported) - set(entries):  # device functions ptxas kept as such
            if name in read:
                assert read[name].frame_size == reported[name].frame, (build.label, name)


def test_spills_and_stack_arrays_show_as_frames(builds: list[Build]) -> None:
    """A spill needs a frame, so a frame of 0 bytes proves there was none: here ptxas spills, the cubin
    says so, and an array indexed at run time takes a frame without a spill."""
    (probe,) = [build for build in builds if "probe" in build.label]
    _, reported = ptxas_report(probe.log)
    read = read_resources(probe.cubin)
    assert reported["spills"].spill_stores > 0 and reported["spills"].spill_loads > 0, probe.log
    assert read["spills"].frame_size == reported["spills"].frame > 0
    assert read["spills"].registers == read["spills"].max_registers == PROBE_CAP
    assert reported["stack_array"].spill_stores == 0 and reported["stack_array"].frame == 256 * 4
    assert read["stack_array"].frame_size == 256 * 4
    barrier = read["barrier_and_shared"]
    assert (barrier.frame_size, barrier.barriers) == (0, 1)
    assert barrier.shared_bytes == 400 + 1024, barrier  # an sm_90 cubin counts the 1 KiB the system reserves
    for build in builds:
        _, reported = ptxas_report(build.log)
        for name, usage in read_resources(build.cubin).items():
            if name in reported and reported[name].spill_stores:
                assert usage.frame_size, (build.label, name)


def test_every_kernel_matches_cuobjdump(builds: list[Build], tmp_path: Path) -> None:
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump, or set $CUOBJDUMP)")
    compared = 0
    for build in builds:
        path = tmp_path / f"{build.label}.cubin"
        path.write_bytes(build.cubin)
        done = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True)
        if "does not contain device code" in done.stdout + done.stderr:
            continue  # cuobjdump 13 does not read ELF ABI 7, which NVRTC 12 writes
        assert done.returncode == 0, done.stderr
        listed = {
            name: {key: int(value) for key, value in re.findall(r"([A-Z]+(?:\[\d\])?):(\d+)", usage)}
            for name, usage in re.findall(r"Function (\S+):\n\s*(.*)", done.stdout)
        }
        read = read_resources(build.cubin)
        kernels = {name for name, usage in read.items() if usage.kernel}
        assert set(listed) == kernels, (build.label, done.stdout)
        for name, theirs in listed.items():
            got = read[name]
            ours = {
                "REG": got.registers,
                "STACK": got.frame_size,
                "SHARED": got.shared_bytes,
                "LOCAL": got.local_bytes,
                "CONSTANT[0]": got.constant0_bytes,
            }
            assert {key: theirs[key] for key in ours} == ours, (build.label, name)
            assert got.min_stack_size in (None, theirs["STACK"]), (build.label, name)
        compared += 1
    if not compared:
        about = subprocess.run([cuobjdump, "--version"], capture_output=True, text=True).stdout
        version = m[1] if (m := re.search(r"release ([\d.]+)", about)) else "?"
        pytest.skip(f"cuobjdump {version} reads none of these cubins (ELF ABI {builds[0].cubin[8]})")


def test_records_of_each_format() -> None:
    data = bytes([Format.NVAL, 0x35, 0, 0, Format.BVAL, 0x4C, 3, 0, Format.HVAL, 0x1B, 0xFF, 0])
    data += bytes([Format.SVAL, 0x2F]) + struct.pack("<HII", 8, 14, 213)
    assert parse_records(data) == [
        Record(0x35, Format.NVAL, None),
        Record(0x4C, Format.BVAL, 3),
        Record(0x1B, Format.HVAL, 255),
        Record(0x2F, Format.SVAL, struct.pack("<II", 14, 213)),
    ]
    names = [record.name for record in parse_records(data)]
    assert names == ["0x35", "NUM_BARRIERS", "MAXREG_COUNT", "REGCOUNT"]


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (bytes([0x07, 0x2F, 0, 0]), "unknown attribute format 0x07"),
        (bytes([Format.SVAL, 0x2F, 8, 0, 1, 2]), "runs past the section's end"),
        (bytes([Format.HVAL, 0x1B]), "truncated"),
    ],
)
def test_bad_records_are_refused(data: bytes, error: str) -> None:
    with pytest.raises(CubinError, match=re.escape(error)):
        parse_records(data)


def test_a_file_that_is_not_a_cubin_is_refused() -> None:
    with pytest.raises(CubinError, match="not an ELF file"):
        read_resources(b"#!/bin/sh\n")
