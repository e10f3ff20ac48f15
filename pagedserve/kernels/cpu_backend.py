"""The CPU backend: the torch reference, with paged attention, the elementwise steps, the few-row GEMM and
the mixture of experts in C++, in float32 or bfloat16 (computed in float32), and linear layers whose weights
are int8 or float8.

The torch reference gathers every decoding sequence's pages into a copy, every layer, every step, and
zeroes the stale tail of each last page so that a masked softmax cannot meet a NaN; on a CPU that costs
more than the attention itself. `pagedserve/kernels/cpu/paged_decode.cpp` and `paged_prefill.cpp` read each K
and V row where it lies, only up to the sequence's length; where the queries and the pool are bfloat16 and
AVX512-BF16 runs, the prefill's two products multiply bfloat16 pairs, with vdpbf16ps or on AMX's tiles.
`pagedserve/kernels/cpu/elementwise.cpp` does RMSNorm (with the residual add), rotary and the SiLU gate in
one pass each, where torch makes a temporary for every operator, and `write_kv.cpp` copies a step's keys and
values into their slots on all threads (index_copy_ took about six times as long).

A float32 model's linear weights are packed at load for `packed_float.cpp`, which serves every number of
rows, faster than MKL's GEMM on the unpacked weight from one row to thousands. Both packed kernels run a
gated MLP's gate and up projection with its SiLU gate in one pass (gated_linear). Where cpu_features.py saw
vpdpbusd run, each int8 linear weight of a float32 model (of a bfloat16 one where vdpbf16ps ran too) is
packed at load for `packed_linear.cpp`, which rounds each activation row to int8 (W8A8) and serves every
number of rows (more than AMX_INT8_SKINNY_ROWS, with K a multiple of 64, on AMX's tiles where they run); so
is each bfloat16 weight of a bfloat16 model where vdpbf16ps ran and AMX does not. Otherwise GEMMs of a
decode step's few rows stream their weight once through `skinny_linear.cpp`, widening bfloat16, int8 or
float8 to float32 in registers, and more rows go to torch: oneDNN for bfloat16 on a CPU that runs it in
hardware (AMX or AVX512-BF16), MKL in float32 otherwise, with a bfloat16 or quantized weight widened to
float32 first. With AMX, oneDNN takes a bfloat16 GEMM of more than AMX_SKINNY_ROWS rows.

The ops are built once per machine by torch's cpp_extension, for this CPU's instruction set, into
cpu-kernels/ in the cache folder, or $PAGEDSERVE_CPU_KERNELS: the first start takes a minute or more on a
few cores, says so, and later starts load the build. An image has no compiler: its build ran `python -m
pagedserve.kernels.cpu_backend x86-64-v3 x86-64-v4` (Dockerfile) into $PAGEDSERVE_CPU_KERNELS, and the worker
loads the best of those levels that its CPU runs. Where there is no build it can run and none can be made, the
worker runs the torch reference and says why. Other dtypes and CUDA tensors take the reference.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve.kernels.backend import (
    AttentionMetadata,
    ExpertWeights,
    LayerAttention,
    PackedWeight,
    QuantizedWeight,
    Routing,
    Weight,
)
from pagedserve.kernels.cpu_features import CpuFeatures
from pagedserve.kernels.torch_ref import TorchBackend, quantized_linear
from pagedserve.plumbing.paths import cache_dir

log = logging.getLogger(__name__)

# Up to this many rows, a GEMM reads its weight faster through skinny_linear than through MKL, which is
# slower at 2-16 rows than at 1 (scripts/bench_cpu_ops.py measures both).
SKINNY_ROWS = 16
# An int8 or float8 weight takes skinny_linear for more rows: widening it there, a few rows at a time, costs
# less than widening all of it for MKL (scripts/bench_quantized.py).
QUANTIZED_SKINNY_ROWS = 128
# With AMX, oneDNN's bfloat16 GEMM reads the weight at the same speed (16 ms for SmolLM2's 120) from 1 row to
# 32; skinny_linear took 10.9 ms at 1 row, 15.7 at 4 and 17.7 at 8 (on an Intel Xeon).
AMX_SKINNY_ROWS = 4
# With AMX-INT8, an int8 x int8 GEMM of more rows than this runs on the tiles: SmolLM2's 120 GEMMs took 6.4,
# 8.8, 28.1 and 181.9 ms at 32, 64, 256 and 1024 rows, against vpdpbusd's 9.6, 16.6, 53.6 and 245.8
# (scripts/bench_quantized.py on an Intel Xeon); at 8-16 rows a scratch timing found them about even.
AMX_INT8_SKINNY_ROWS = 16

CSRC = Path(__file__).parent / "cpu"
SOURCES = [
    CSRC / name
    for name in (
        "paged_decode.cpp",
        "paged_prefill.cpp",
        "write_kv.cpp",
        "elementwise.cpp",
        "skinny_linear.cpp",
        "packed_linear.cpp",
        "packed_float.cpp",
        "moe.cpp",
        "features.cpp",
        "bindings.cpp",
    )
]
HEADERS = [CSRC / name for name in ("amx.h", "attention_steps.h", "checks.h", "floats.h")]
# The x86-64 levels (GCC's -march names) an image ships, worst first, each with the flags /proc/cpuinfo
# must show for a CPU to run it; "native" is this CPU's own.
_V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
LEVELS = {
    "x86-64-v3": frozenset(_V3),
    "x86-64-v4": frozenset(_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
}


def cflags(target: str) -> list[str]:
    """-ffast-math vectorizes exp and the reductions (the kernels read only slots that hold written, finite
    values). at::parallel_for is OpenMP inlined from torch's headers: without -fopenmp it runs on one thread.
    The library it links is libgomp.so.1, the one torch has loaded already. -mno-recip keeps vector
    divisions exact: -ffast-math otherwise turns them into an estimate and a Newton step, vrcp14ps in a
    16-lane loop and the coarser vrcpps in its 8-lane tail, so a SiLU gate's product came out a bfloat16
    step apart by where in its row it fell (seen on a Zen 4)."""
    return ["-O3", f"-march={target}", "-ffast-math", "-mno-recip", "-fopenmp"]


def kernels_dir() -> Path:
    """$PAGEDSERVE_CPU_KERNELS, or cpu-kernels/ in the cache folder: one <name>.so a finished build."""
    return Path(os.environ.get("PAGEDSERVE_CPU_KERNELS") or cache_dir() / "cpu-kernels")


def build_name(target: str) -> str:
    """The build's name keys the sources, the target (for native, this CPU), the flags and torch, so that a
    shared folder never mixes builds."""
    key = hashlib.sha256(
        b"".join(source.read_bytes() for source in [*SOURCES, *HEADERS])
        + (_cpu_flags() if target == "native" else target).encode()
        + str(cflags(target)).encode()
        + torch.__version__.encode()
    ).hexdigest()
    return f"pagedserve_cpu_{key[:12]}"


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled C++ ops: a finished build this CPU runs (its own, else the best level), or a new build for
    this CPU; None, with a warning, when neither can be had."""
    folder = kernels_dir()
    try:
        for target in ["native", *runnable_levels()]:
            library = folder / f"{build_name(target)}.so"
            if library.exists():
                log.info("C++ CPU kernels: loaded %s", library)
                return _import(library)
        return build("native")
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, or no ninja
        log.warning(
            "the C++ CPU kernels could not be built (%s), and %s holds no build this CPU runs; running the "
            "torch reference",
            exc,
            folder,
        )
        return None


def build(target: str) -> ModuleType:
    """Builds the ops for target (native or one of LEVELS that this CPU runs: the build loads them) into
    kernels_dir(), and loads them; raises where they cannot be built."""
    from torch.utils import cpp_extension

    name = build_name(target)
    library = kernels_dir() / f"{name}.so"
    work = kernels_dir() / name  # cpp_extension's: objects, ninja's files, and its own copy of the library
    compiler = os.environ.get("CXX") or "c++"  # cpp_extension's choice (get_cxx_compiler)
    if shutil.which(compiler) is None:
        raise OSError(f"no C++ compiler: {compiler} is not on PATH")
    work.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    with _build_lock(work):
        if library.exists():  # another process built it while this one waited
            log.info("C++ CPU kernels: loaded %s", library)
            return _import(library)
        what = "this CPU" if target == "native" else target
        log.info(
            "building the C++ CPU kernels for %s into %s: a minute or more, once; later starts load it",
            what,
            work,
        )
        start = time.monotonic()
        module = cpp_extension.load(
            name,
            [str(source) for source in SOURCES],
            extra_cflags=cflags(target),
            extra_ldflags=["-fopenmp"],
            build_directory=str(work),
        )
        # Published whole, by a rename: a library at this path is a finished build.
        shutil.copyfile(work / f"{name}.so", work / "published.so")
        os.replace(work / "published.so", library)
        log.info("built the C++ CPU kernels in %.0f s: %s", time.monotonic() - start, library)
        return module


def runnable_levels() -> list[str]:
    """The levels of LEVELS that this CPU runs, best first."""
    flags = set(_cpu_flags().split())
    return [level for level, needs in reversed(LEVELS.items()) if needs <= flags]


def _import(library: Path) -> ModuleType:
    """Loads a built library as cpp_extension does; its file name is its module's name."""
    spec = importlib.util.spec_from_file_location(library.stem, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def main(targets: list[str]) -> None:
    """Builds the ops for each level named that this CPU runs, and says which it skips (an image's build)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for target in targets:
        if target not in LEVELS:
            raise SystemExit(f"{target} is not one of {', '.join(LEVELS)}")
        if target in runnable_levels():
            build(target)
        else:
            log.info("not building the C++ CPU kernels for %s: this CPU does not run it", target)


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, ops: ModuleType, features: CpuFeatures | None = None) -> None:
        """features: what this CPU was seen to run (pagedserve.kernels.cpu_features); None assumes no bfloat16
        arithmetic, whose paths are right on any CPU."""
        super().__init__()
        self._ops = ops
        self._dot_bf16 = features is not None and features.avx512_bf16.usable
        self._dot_int8 = features is not None and features.avx512_vnni.usable
        # With AMX's tiles, oneDNN's bfloat16 GEMM on [N, K] took a sixth of the packed one's time at 1024
        # rows and a third at 64, and less from 8 rows on (scripts/bench_quantized.py): bfloat16 weights
        # stay [N, K] there, for skinny_linear up to AMX_SKINNY_ROWS and oneDNN above.
        self._amx = features is not None and features.amx_bf16.usable
        # The attention's tile kernel runs AVX512-BF16 between its tile products, the int8 GEMM's VNNI.
        self._amx_attention = self._amx and self._dot_bf16
        self._amx_int8 = self._dot_int8 and features is not None and features.amx_int8.usable
        self._pack_bf16 = self._dot_bf16 and not self._amx
        self._native_bf16 = features is not None and features.native_bf16

    def write_kv(
        self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if not (_ours(k) and _ours(kv_layer)):
            return super().write_kv(kv_layer, k, v, slot_mapping)
        self._ops.write_kv(kv_layer, k, v, slot_mapping)

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

    def prepare_linear(self, weight: Weight, dtype: torch.dtype) -> Weight:
        """A weight packed (a copy: a vocabulary projection tied to the embedding keeps the embedding too):
        a float32 model's for packed_float.cpp; for packed_linear.cpp, an int8 one where this CPU runs
        vpdpbusd (a bfloat16 model's where it runs vdpbf16ps too), and where it runs vdpbf16ps and
        activations are bfloat16, a bfloat16 one where AMX does not run."""
        data = weight.data if isinstance(weight, QuantizedWeight) else weight
        if (
            not isinstance(data, torch.Tensor)
            or data.device.type != "cpu"
            or data.dtype not in self._packed_dtypes(dtype)
            or data.shape[1] % pack_step(data.dtype)
        ):
            return weight
        group = self._ops.packed_float_group() if data.dtype == torch.float32 else PACK_GROUP
        return pack_linear(weight, group)  # type: ignore[arg-type]

    def _packed_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The weights' dtypes prepare_linear packs for a model that computes in dtype: float32, and int8
        for vpdpbusd, for float32; for bfloat16, where vdpbf16ps runs, bfloat16 (not where AMX runs
        oneDNN's) and int8 for vpdpbusd. (packed_linear.cpp stores bfloat16 outputs with vcvtneps2bf16.)"""
        int8 = (torch.int8,) if self._dot_int8 else ()
        if dtype == torch.float32:
            return (torch.float32, *int8)
        if dtype != torch.bfloat16 or not self._dot_bf16:
            return ()
        return ((torch.bfloat16,) if self._pack_bf16 else ()) + int8

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not _ours(x):
            return super().linear(x, weight, bias)
        rows = x.shape[0]
        if isinstance(weight, PackedWeight):
            if weight.data.dtype == torch.float32 and x.dtype == torch.float32:
                return self._ops.packed_float_linear(x, weight.data, bias, weight.rows, False)
            if _packed_linear_takes(x, weight):
                return self._packed_linear(x, weight, bias, gated=False)
            return super().linear(x, weight, bias)
        if isinstance(weight, QuantizedWeight):
            if rows > QUANTIZED_SKINNY_ROWS:
                return quantized_linear(x, weight, bias)
            return self._ops.skinny_linear(x, weight.data, weight.scale, bias)
        if rows <= (AMX_SKINNY_ROWS if self._amx and x.dtype == torch.bfloat16 else SKINNY_ROWS):
            return self._ops.skinny_linear(x, weight, None, bias)
        if x.dtype == torch.bfloat16 and not self._native_bf16:
            wide = None if bias is None else bias.float()
            return F.linear(x.float(), weight.float(), wide).to(x.dtype)
        return F.linear(x, weight, bias)

    def gated_linear(
        self, x: torch.Tensor, gate_up: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A packed weight's gate and up products meet in the kernel (where each half is whole groups of
        rows): it writes silu(gate) * up, not a product twice as wide for silu_and_mul to read back. A 4 x 512
        int8 prefill step took 336-339 ms so, against 350-355 unfused (profile_step.py, an AMX Xeon); 30 of
        SmolLM2's float32 gate and up projections of 1024 rows, 682 ms against 796 (the AVX2 EPYC)."""
        if isinstance(gate_up, PackedWeight) and x.device.type == "cpu":
            if gate_up.data.dtype == torch.float32 and x.dtype == torch.float32:
                if gate_up.rows % (2 * self._ops.packed_float_group()) == 0:
                    return self._ops.packed_float_linear(x, gate_up.data, bias, gate_up.rows, True)
            elif _packed_linear_takes(x, gate_up) and gate_up.rows % (2 * PACK_GROUP) == 0:
                return self._packed_linear(x, gate_up, bias, gated=True)
        return super().gated_linear(x, gate_up, bias)

    def _packed_linear(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, gated: bool
    ) -> torch.Tensor:
        tiles = self._amx_int8 and x.shape[0] > AMX_INT8_SKINNY_ROWS
        return self._ops.packed_linear(
            x, weight.data, weight.scale, weight.sums, bias, weight.rows, tiles, gated
        )

    def moe(self, x: torch.Tensor, experts: ExpertWeights, routing: Routing) -> torch.Tensor:
        if not _ours(x):
            return super().moe(x, experts, routing)
        e, r = experts, routing
        return self._ops.moe(
            x.contiguous(),
            e.router,
            e.router_bias,
            e.gate_up,
            e.gate_up_bias,
            e.down,
            e.down_bias,
            r.top_k,
            r.renormalize,
            r.softmax_of_top,
            r.swiglu_limit,
            r.swiglu_alpha,
        )

    def paged_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, layer: LayerAttention
    ) -> torch.Tensor:
        if not _ours(q):
            return super().paged_attention(q, kv_layer, meta, layer)
        n = meta.num_decodes  # the decodes' n queries come first, a token each
        if n == q.shape[0]:
            return self._decode_all(q, kv_layer, meta, layer)
        sinks = None if layer.sinks is None else layer.sinks.float()
        prefills = self._ops.paged_prefill(
            *(
                q[n:].contiguous(),
                kv_layer,
                meta.block_tables[n:],
                meta.seq_lens[n:],
                meta.query_start[n:] - n,
            ),
            *(layer.scale, layer.window, layer.softcap, sinks),
            *(self._dot_bf16, self._amx_attention),
        )
        if not n:  # a step of prompts alone: their output as it is, not copied into another
            return prefills
        return torch.cat((self._decode_all(q[:n], kv_layer, meta, layer), prefills))

    def _decode_all(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, layer: LayerAttention
    ) -> torch.Tensor:
        if not _ours(q):
            return super()._decode_all(q, kv_layer, meta, layer)
        n = q.shape[0]
        tables, lens = meta.block_tables[:n], meta.seq_lens[:n]
        sinks = None if layer.sinks is None else layer.sinks.float()
        return self._ops.paged_decode(
            q.contiguous(),
            kv_layer,
            tables,
            lens,
            layer.scale,
            layer.window,
            layer.softcap,
            sinks,
            self._dot_bf16,
        )


PACK_GROUP = 32  # output rows packed_linear.cpp reads together


def pack_step(dtype: torch.dtype) -> int:
    """The consecutive k that packed_linear.cpp multiplies at once: vdpbf16ps's pairs, vpdpbusd's fours;
    packed_float.cpp's one."""
    return {torch.int8: 4, torch.bfloat16: 2}.get(dtype, 1)


def pack_linear(weight: torch.Tensor | QuantizedWeight, group: int = PACK_GROUP) -> PackedWeight:
    """weight [N, K] (float32, bfloat16, or int8 with its scale) as packed_float.cpp and packed_linear.cpp
    read it: its rows in groups (the last padded with zeros; packed_float.cpp's of `packed_float_group()`
    rows, packed_linear.cpp's of PACK_GROUP), each group [K / step, group, step]: step consecutive k of the
    group's rows together (pack_step); an int8 weight also keeps 128 times each row's sum, for the kernel to
    take off again (it multiplies x offset by 128, as unsigned bytes)."""
    data, scale = (weight.data, weight.scale) if isinstance(weight, QuantizedWeight) else (weight, None)
    rows, k = data.shape
    step = pack_step(data.dtype)
    padded = torch.cat((data, data.new_zeros(-rows % group, k)))
    packed = padded.view(-1, group, k // step, step).permute(0, 2, 1, 3).contiguous()
    sums = 128 * padded.sum(1, dtype=torch.int32) if data.dtype == torch.int8 else None
    return PackedWeight(packed, scale, rows, sums)


def _packed_linear_takes(x: torch.Tensor, weight: PackedWeight) -> bool:
    """packed_linear.cpp multiplies bfloat16 rows by its weights, and float32 rows by int8 ones."""
    return x.dtype == torch.bfloat16 or weight.data.dtype == torch.int8


def _ours(x: torch.Tensor) -> bool:
    """The C++ ops take float32 and bfloat16 CPU tensors; the reference takes the rest."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


if __name__ == "__main__":
    main(sys.argv[1:])
