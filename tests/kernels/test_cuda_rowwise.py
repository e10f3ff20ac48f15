"""The CUDA row-wise kernels (RMSNorm, rotary, SiLU and mul) against TorchBackend on the same device, and
the typed wrappers' refusal of bad arguments before any launch.

Inputs that are views of wider rows have NaN in the columns around them (tests/kernels/cases.py), which a
kernel that ignores a stride would read.

On a CUDA device with CuPy, else in the kernels' emulator (pagedserve/kernels/emulator.py) on the CPU. The
`backend` fixture is in tests/kernels/conftest.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from pagedserve.kernels import cuda_ops
from pagedserve.kernels.backend import AttentionMetadata, LayerAttention
from pagedserve.kernels.cupy_backend import CupyBackend
from pagedserve.kernels.tuning import Tuning
from services.worker.models.decoder import rotary_table
from tests.kernels.cases import (
    DEVICE,
    DTYPES,
    EPS,
    GROUPS,
    HEAD_DIMS,
    KV_HEADS,
    NAN,
    OFFSETS,
    PAD,
    REFERENCE,
    assert_close,
    dtype_name,
    fused_qkv,
    generator,
    padded_rows,
    randn,
    same_bits,
)
from tests.kernels.steps import Chunk, llama_spec, make_metadata

pytestmark = pytest.mark.cuda_kernels  # on a GPU, else in the emulator on the CPU: tests/devices.py


# Row-wise kernels ---------------------------------------------------------------------------------------

NORM_SHAPES = [(7, 64), (5, 1000), (3, 4096), (6, 4, 64), (5, 4, 128)]  # [T, H], and [T, heads, D]


@OFFSETS
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_rms_norm(
    backend: CupyBackend, dtype: torch.dtype, shape: tuple[int, ...], with_residual: bool, offset: int
) -> None:
    gen = generator(8)
    rows, width = shape[0], math.prod(shape[1:])
    start = PAD + offset  # rows PAD apart, as q's are
    x = padded_rows(gen, rows, offset + width, dtype)[:, start : start + width].view(shape)
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=gen)).to(device=DEVICE, dtype=dtype)
    residual = randn(gen, *shape, dtype=dtype) if with_residual else None
    x_before = x.clone()
    expected, expected_residual = REFERENCE.rms_norm(
        x, weight, EPS, None if residual is None else residual.clone()
    )

    normed, new_residual = backend.rms_norm(x, weight, EPS, residual)

    assert normed.is_contiguous() and normed.dtype == dtype
    assert_close(normed, expected, dtype)
    # the sum is rounded to the dtype once, by both: it must match to the bit
    assert torch.equal(new_residual, expected_residual), "the new residual is not x + residual"
    assert torch.equal(x, x_before), "x changed"


@OFFSETS
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_rotary_in_place(
    backend: CupyBackend, dtype: torch.dtype, head_dim: int, group: int, offset: int
) -> None:
    gen = generator(9)
    spec = llama_spec(head_dim, max_positions=4096)
    cos_sin = rotary_table(spec, DEVICE, dtype)
    tokens = 37
    positions = torch.randint(0, spec.max_model_len, (tokens,), generator=gen).to(DEVICE)
    fused = fused_qkv(gen, tokens, group * KV_HEADS, head_dim, dtype, offset)
    fused.v.fill_(NAN)  # V, like the padding columns, is neither read nor written
    expected_q, expected_k = REFERENCE.rotary(fused.q.clone(), fused.k.clone(), positions, cos_sin)
    buffer_before = fused.buffer.clone()

    q_out, k_out = backend.rotary(fused.q, fused.k, positions, cos_sin)

    assert q_out.data_ptr() == fused.q.data_ptr() and k_out.data_ptr() == fused.k.data_ptr(), "not in place"
    assert_close(fused.q, expected_q, dtype, "q")
    assert_close(fused.k, expected_k, dtype, "k")
    qk_start = PAD + offset
    qk_end = qk_start + (group + 1) * KV_HEADS * head_dim
    assert same_bits(fused.buffer[:, :qk_start], buffer_before[:, :qk_start])
    assert same_bits(fused.buffer[:, qk_end:], buffer_before[:, qk_end:]), "V or the padding changed"


@OFFSETS
@pytest.mark.parametrize("inner", [64, 1000, 5632])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_silu_and_mul(backend: CupyBackend, dtype: torch.dtype, inner: int, offset: int) -> None:
    gen = generator(10)
    start = PAD + offset  # rows further apart than 2 I
    x = padded_rows(gen, 9, offset + 2 * inner, dtype)[:, start : start + 2 * inner]

    out = backend.silu_and_mul(x)

    assert out.shape == (9, inner) and out.is_contiguous() and out.dtype == dtype
    assert_close(out, REFERENCE.silu_and_mul(x), dtype)


# The wrappers' checks -----------------------------------------------------------------------------------


def zeros(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


def index(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


POOL = (2, 4, 16, 2, 64)  # a valid kv_layer: [2, P, B, Hkv, D]


def prefill_meta(**changes: torch.Tensor) -> AttentionMetadata:
    """A valid step of one prefill chunk of 3 tokens on page 1, but for `changes`."""
    return dataclasses.replace(make_metadata([], [Chunk((1,), 0, 3)], 16, DEVICE), **changes)


# Each call is valid but for the one thing its name says, and must raise ValueError before any launch.
BAD_CALLS: dict[str, Callable[[Tuning], object]] = {
    "kv_write-k-in-another-dtype": lambda t: cuda_ops.kv_write(
        zeros(*POOL), zeros(3, 2, 64, dtype=torch.float16), zeros(3, 2, 64), index(3), t
    ),
    "kv_write-float64": lambda t: cuda_ops.kv_write(
        zeros(*POOL, dtype=torch.float64),
        zeros(3, 2, 64, dtype=torch.float64),
        zeros(3, 2, 64, dtype=torch.float64),
        index(3),
        t,
    ),
    "kv_write-int32-slots": lambda t: cuda_ops.kv_write(
        zeros(*POOL), zeros(3, 2, 64), zeros(3, 2, 64), index(3, dtype=torch.int32), t
    ),
    "kv_write-k-dims-strided": lambda t: cuda_ops.kv_write(
        zeros(*POOL), zeros(3, 64, 2).transpose(1, 2), zeros(3, 2, 64), index(3), t
    ),
    "kv_write-pool-not-contiguous": lambda t: cuda_ops.kv_write(
        zeros(2, 8, 16, 2, 64)[:, ::2], zeros(3, 2, 64), zeros(3, 2, 64), index(3), t
    ),
    "decode-page-size-12": lambda t: cuda_ops.paged_decode(
        zeros(2, 4, 64),
        zeros(2, 4, 64),
        zeros(2, 4, 12, 2, 64),
        index(2, 3),
        index(2),
        16,
        LayerAttention(0.125),
        t,
    ),
    "decode-head-dim-96": lambda t: cuda_ops.paged_decode(
        zeros(2, 4, 96),
        zeros(2, 4, 96),
        zeros(2, 4, 16, 2, 96),
        index(2, 3),
        index(2),
        16,
        LayerAttention(0.1),
        t,
    ),
    "decode-17-query-heads-a-kv-head": lambda t: cuda_ops.paged_decode(
        zeros(2, 17, 64),
        zeros(2, 17, 64),
        zeros(2, 4, 16, 1, 64),
        index(2, 3),
        index(2),
        16,
        LayerAttention(0.125),
        t,
    ),
    "decode-block-tables-not-contiguous": lambda t: cuda_ops.paged_decode(
        zeros(2, 4, 64),
        zeros(2, 4, 64),
        zeros(*POOL),
        index(2, 6)[:, ::2],
        index(2),
        16,
        LayerAttention(0.125),
        t,
    ),
    "decode-out-not-contiguous": lambda t: cuda_ops.paged_decode(
        zeros(4, 4, 64)[::2],
        zeros(2, 4, 64),
        zeros(*POOL),
        index(2, 3),
        index(2),
        16,
        LayerAttention(0.125),
        t,
    ),
    "prefill-int32-positions": lambda t: cuda_ops.paged_prefill(
        zeros(3, 4, 64),
        zeros(3, 4, 64),
        zeros(*POOL),
        prefill_meta(prefill_pos=index(3, dtype=torch.int32)),
        LayerAttention(0.1),
        t,
    ),
    "decode-sinks-of-another-length": lambda t: cuda_ops.paged_decode(
        zeros(2, 4, 64),
        zeros(2, 4, 64),
        zeros(*POOL),
        index(2, 3),
        index(2),
        16,
        LayerAttention(0.1, sinks=zeros(2)),
        t,
    ),
    "prefill-sinks-in-float32": lambda t: cuda_ops.paged_prefill(
        zeros(3, 4, 64),
        zeros(3, 4, 64),
        zeros(*POOL),
        prefill_meta(),
        LayerAttention(0.1, sinks=zeros(4, dtype=torch.float32)),
        t,
    ),
    "decode-negative-window": lambda t: cuda_ops.paged_decode(
        zeros(2, 4, 64),
        zeros(2, 4, 64),
        zeros(*POOL),
        index(2, 3),
        index(2),
        16,
        LayerAttention(0.1, window=-1),
        t,
    ),
    "rms_norm-x-strided": lambda t: cuda_ops.rms_norm(zeros(4, 256)[:, ::2], zeros(128), EPS, None, t),
    "rms_norm-weight-in-float32": lambda t: cuda_ops.rms_norm(
        zeros(4, 128), zeros(128, dtype=torch.float32), EPS, None, t
    ),
    "rms_norm-residual-not-contiguous": lambda t: cuda_ops.rms_norm(
        zeros(4, 128), zeros(128), EPS, zeros(8, 128)[::2], t
    ),
    "rotary-cos-sin-in-float32": lambda t: cuda_ops.rotary(
        zeros(3, 4, 64), zeros(3, 2, 64), index(3), zeros(16, 2, 64, dtype=torch.float32), t
    ),
    "rotary-positions-not-contiguous": lambda t: cuda_ops.rotary(
        zeros(3, 4, 64), zeros(3, 2, 64), index(6)[::2], zeros(16, 2, 64), t
    ),
    "silu_and_mul-x-strided": lambda t: cuda_ops.silu_and_mul(zeros(4, 256)[:, ::2], t),
    "silu_and_mul-odd-width": lambda t: cuda_ops.silu_and_mul(zeros(4, 7), t),
}


@pytest.mark.parametrize("call", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_wrappers_reject_bad_arguments(backend: CupyBackend, call: Callable[[Tuning], object]) -> None:
    with pytest.raises(ValueError):
        call(backend.tuning)
