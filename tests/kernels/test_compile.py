"""Every CUDA kernel compiles, through the raw NVRTC API and with no GPU, for sm_80 and sm_90, in every
variant the worker can ask for; the attention kernels' largest variants keep every array in registers."""

from __future__ import annotations

import itertools
import re

import pytest

from pagedserve.kernels.cuda_experts import CUDA_TILES
from pagedserve.kernels.cuda_ops import HEAD_DIMS, PAGE_SIZES
from pagedserve.kernels.nvrtc import DTYPE_MACROS, KERNEL_FILES, TENSOR_CORE, compile_cubin, compile_ptx
from pagedserve.kernels.resources import read_resources
from pagedserve.kernels.tuning import TUNINGS

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs cupy and nvidia-cuda-nvrtc-cu12")

ARCHS = [f"sm_{cc}" for cc in sorted(TUNINGS)]
ATTENTION = ("paged_decode", "paged_prefill")
ROW_WISE = [name for name in KERNEL_FILES if name not in (*ATTENTION, *TENSOR_CORE)]
# What the tensor-core decode takes beside the attention kernels' shape: the tuning's values.
DECODE_MMA = {"STAGES": TUNINGS[90].decode_stages, "MAX_PARTITION": TUNINGS[90].max_partition}
# Each attention kernel with the dtypes it is built for: the tensor-core ones take 16-bit types only.
ATTENTION_DTYPES = [
    *((name, dtype) for name in ATTENTION for dtype in DTYPE_MACROS.values()),
    *((name, dtype) for name in TENSOR_CORE for dtype in ("DTYPE_F16", "DTYPE_BF16")),
]


# The compile-time shapes the wrappers ask of the row-wise kernels, beside VEC (cuda_ops._pack).
ROW_WISE_SHAPES = {"rms_norm": [{"ITEMS": 1}, {"ITEMS": 4}], "rotary": [{"HEAD_DIM": d} for d in HEAD_DIMS]}
VECTOR_WIDTHS = {"DTYPE_F32": 4, "DTYPE_F16": 8, "DTYPE_BF16": 8}  # 16 bytes


@pytest.mark.parametrize(
    ("arch", "name", "dtype"), list(itertools.product(ARCHS, ROW_WISE, DTYPE_MACROS.values()))
)
def test_row_wise_kernels_compile(arch: str, name: str, dtype: str) -> None:
    for shape in ROW_WISE_SHAPES.get(name, [{}]):
        for vec in (1, VECTOR_WIDTHS[dtype]):
            cubin, _ = compile_cubin(name, arch, {dtype: 1, "VEC": vec, **shape})
            assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("name", ROW_WISE)
def test_row_wise_kernels_move_16_bytes_an_access(name: str) -> None:
    """With VEC at 16 bytes, every global load and store of the elements is a 128-bit one (the 64-bit
    loads are of index tensors: positions, slots)."""
    ptx = compile_ptx(name, "sm_90", {"DTYPE_BF16": 1, "VEC": 8, **ROW_WISE_SHAPES.get(name, [{}])[-1]})
    accesses = re.findall(r"\b(?:ld|st)\.global[.\w]*", ptx)
    elements = [access for access in accesses if not access.endswith("64")]
    assert elements and all(".v4." in access for access in elements), sorted(set(accesses))


@pytest.mark.parametrize(
    ("name", "slow"), [("silu_and_mul", "div.rn"), ("rotary", "div."), ("rotary", "rem.")]
)
def test_row_wise_kernels_do_no_slow_division(name: str, slow: str) -> None:
    """silu's divide is the fast one; rotary finds its head and column by shifts, HEAD_DIM being fixed."""
    ptx = compile_ptx(name, "sm_90", {"DTYPE_BF16": 1, "VEC": 8, **ROW_WISE_SHAPES.get(name, [{}])[-1]})
    assert slow not in ptx


@pytest.mark.parametrize(
    ("arch", "kernel", "head_dim", "page_size"),
    list(itertools.product(ARCHS, ATTENTION_DTYPES, HEAD_DIMS, PAGE_SIZES)),
)
def test_attention_kernels_compile(arch: str, kernel: tuple[str, str], head_dim: int, page_size: int) -> None:
    name, dtype = kernel
    tuning = TUNINGS[int(arch[3:])]
    macros = {
        dtype: 1,
        "HEAD_DIM": head_dim,
        "PAGE_SIZE": page_size,
        "GROUP": 4,
        "NUM_WARPS": tuning.decode_warps,
        **(DECODE_MMA if name == "paged_decode_mma" else {}),
    }
    cubin, _ = compile_cubin(name, arch, macros)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize(
    ("arch", "name", "group"), list(itertools.product(ARCHS, (*ATTENTION, *TENSOR_CORE), (1, 3, 8, 16)))
)
def test_attention_kernels_do_not_spill(arch: str, name: str, group: int) -> None:
    """Read from the cubin itself (pagedserve/kernels/resources.py), not from ptxas's log, which NVRTC 13
    leaves empty when it serves a compile from its cache: a spill needs a stack frame, so frames of 0 bytes
    prove none. (Every function: the kernels, and ptxas's internal subroutines they call.)"""
    macros = {"DTYPE_BF16": 1, "HEAD_DIM": 128, "PAGE_SIZE": 16, "GROUP": group, "NUM_WARPS": 4}
    cubin, _ = compile_cubin(name, arch, {**macros, **(DECODE_MMA if name == "paged_decode_mma" else {})})
    functions = read_resources(cubin)
    assert name in functions and functions[name].kernel, sorted(functions)
    frames = {function: usage.frame_size for function, usage in functions.items()}
    assert set(frames.values()) == {0}, frames
    stacks = {function: usage.min_stack_size for function, usage in functions.items() if usage.kernel}
    assert set(stacks.values()) <= {None, 0}, stacks


@pytest.mark.parametrize(("arch", "dtype"), list(itertools.product(ARCHS, DTYPE_MACROS.values())))
def test_the_experts_grouped_gemms_compile_with_the_cuda_tiles(arch: str, dtype: str) -> None:
    cubin, _ = compile_cubin("moe", arch, {dtype: 1, **CUDA_TILES.macros})
    assert cubin[:4] == b"\x7fELF"
