"""The C++ CPU row-wise ops (RMSNorm, rotary, the KV write, SiLU and mul, the few-row GEMM) against the
torch reference, on fresh random float32 and bfloat16 inputs, and the GEMM with int8 and float8 weights.
Inputs that are views of wider rows have NaN in the columns around them, which an op that ignores a stride
would read.

In bfloat16 the ops compute in float32 and round where transformers rounds (the reference computes in
bfloat16 op by op), so they agree to within one rounding of bfloat16: half a step, 2^-9 of the value."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import subprocess

import pytest
import torch

from pagedserve.kernels.backend import PackedWeight, QuantizedWeight, Weight
from pagedserve.kernels.cpu_backend import (
    AMX_INT8_SKINNY_ROWS,
    QUANTIZED_SKINNY_ROWS,
    CpuBackend,
    cpu_ops,
    pack_linear,
)
from pagedserve.kernels.cpu_features import CpuFeatures, Feature, cpu_features
from pagedserve.kernels.torch_ref import TorchBackend
from services.worker.models.decoder import rotary_table
from tests.kernels.steps import llama_spec

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
REFERENCE = TorchBackend()
PAD = 16
EPS = 1e-6
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
CLOSE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-8, "atol": 2**-8}}


@pytest.fixture(scope="module")
def backend() -> CpuBackend:
    ops = cpu_ops()
    assert ops is not None, "a compiler is here, so the C++ ops must build"
    return CpuBackend(ops)


@pytest.fixture(scope="module")
def backends(backend: CpuBackend) -> list[CpuBackend]:
    """The backend without bfloat16 or int8 arithmetic, and, where this CPU was seen to run either, the one
    that multiplies bfloat16 pairs with vdpbf16ps or int8 ones with vpdpbusd."""
    found = cpu_features()
    runs = found.avx512_bf16.usable or found.avx512_vnni.usable
    return [backend, CpuBackend(cpu_ops(), found)] if runs else [backend]


def packed_runs(found: CpuFeatures, weight: Weight, x_dtype: torch.dtype) -> bool:
    """Whether packed_linear.cpp multiplies x of this dtype by this weight here: int8 ones on vpdpbusd (for
    bfloat16 x, where vdpbf16ps runs too: it stores their outputs), bfloat16 ones on vdpbf16ps."""
    if isinstance(weight, QuantizedWeight):
        return found.avx512_vnni.usable and (x_dtype == torch.float32 or found.avx512_bf16.usable)
    return found.avx512_bf16.usable


def padded_rows(
    gen: torch.Generator, rows: int, width: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[rows, width] random values: a view into rows PAD wider on each side, which hold NaN."""
    buffer = torch.full((rows, width + 2 * PAD), float("nan"), dtype=dtype)
    buffer[:, PAD : PAD + width] = torch.randn(rows, width, generator=gen).to(dtype)
    return buffer[:, PAD : PAD + width]


@DTYPES
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (40, 1000), (6, 9, 64), (5, 4, 128)], ids=str)
def test_rms_norm(
    backend: CpuBackend, shape: tuple[int, ...], with_residual: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + with_residual)
    x = padded_rows(gen, shape[0], torch.Size(shape[1:]).numel(), dtype).unflatten(1, shape[1:])
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    x_before = x.clone()
    expected, expected_residual = REFERENCE.rms_norm(x, weight, EPS, residual)

    normed, new_residual = backend.rms_norm(x, weight, EPS, residual)

    assert normed.shape == shape and normed.dtype == dtype and not normed.isnan().any()
    torch.testing.assert_close(normed, expected, **CLOSE[dtype])
    assert torch.equal(new_residual, expected_residual), "the new residual is not x + residual"
    assert torch.equal(x, x_before), "x changed"


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_in_place(backend: CpuBackend, head_dim: int, tokens: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim + tokens)
    spec = llama_spec(head_dim, max_positions=4096)
    cos_sin = rotary_table(spec, torch.device("cpu"), dtype)
    positions = torch.randint(0, spec.max_model_len, (tokens,), generator=gen)
    widths = [9 * head_dim, 3 * head_dim, 3 * head_dim]
    qkv = padded_rows(gen, tokens, sum(widths), dtype)
    q, k, v = (part.unflatten(1, (-1, head_dim)) for part in qkv.split(widths, dim=-1))
    expected_q, expected_k = REFERENCE.rotary(q.clone(), k.clone(), positions, cos_sin)
    v_before = v.clone()

    q_out, k_out = backend.rotary(q, k, positions, cos_sin)

    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "not in place"
    torch.testing.assert_close(q, expected_q, **CLOSE[dtype])
    torch.testing.assert_close(k, expected_k, **CLOSE[dtype])
    assert torch.equal(v, v_before), "V changed"


def test_rotary_refuses_a_position_past_its_table(backend: CpuBackend) -> None:
    cos_sin = torch.zeros(8, 2, 64)
    q, k = torch.zeros(2, 3, 64), torch.zeros(2, 1, 64)
    with pytest.raises(RuntimeError, match="past the rotary table"):
        backend.rotary(q, k, torch.tensor([3, 8]), cos_sin)


# (the model's dtype, its pool's): a float32 model may keep a bfloat16 pool (--kv-cache-dtype), whose write
# rounds; a bfloat16 model keeps a bfloat16 one.
@pytest.mark.parametrize(
    ("dtype", "pool_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=["float32", "float32-pool-bfloat16", "bfloat16"],
)
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_write_kv_puts_each_token_in_its_slot_as_the_reference_does(
    backend: CpuBackend, tokens: int, dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    """k and v are views of the fused QKV output's wider rows, which hold NaN around them; the slots are
    scattered over the pool, some are padding (-1), and every slot not named keeps what it held."""
    gen = torch.Generator().manual_seed(tokens)
    heads, head_dim, pages, page_size = 3, 64, 40, 16
    widths = [9 * head_dim, heads * head_dim, heads * head_dim]
    _, k, v = (
        part.unflatten(1, (-1, head_dim))
        for part in padded_rows(gen, tokens, sum(widths), dtype).split(widths, dim=-1)
    )
    # Slot 0 is the null page's, which no token takes (the reference writes its padding rows there).
    slots = 1 + torch.randperm(pages * page_size - 1, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.2] = -1
    pool = torch.randn(2, pages, page_size, heads, head_dim, generator=gen).to(pool_dtype)
    expected = pool.clone()
    REFERENCE.write_kv(expected, k, v, slots)

    backend.write_kv(pool, k, v, slots)

    assert torch.equal(pool, expected)


@DTYPES
@pytest.mark.parametrize("inner", [64, 1536, 5632])
def test_silu_and_mul(backend: CpuBackend, inner: int, dtype: torch.dtype) -> None:
    x = padded_rows(torch.Generator().manual_seed(inner), 9, 2 * inner, dtype)

    out = backend.silu_and_mul(x)

    assert out.shape == (9, inner) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, REFERENCE.silu_and_mul(x), **CLOSE[dtype])


@DTYPES
def test_silu_and_mul_does_not_depend_on_where_in_a_row_a_value_falls(
    backend: CpuBackend, dtype: torch.dtype
) -> None:
    """The same gate and up give the same product in a long row as in a row of 16 (a vector loop's body
    against its tail). With -ffast-math's vector division (an estimate and a Newton step, precise to 14 bits
    before it in the body and 12 in the tail on AVX-512), 1 in about 1000 bfloat16 products near a rounding
    midpoint came out a step apart; the GEMMs' fused gate, which stores 16 at a time, then differed from
    silu_and_mul of the product."""
    gen = torch.Generator().manual_seed(16)
    gates, ups = (torch.randn(4096, generator=gen) * 8 for _ in range(2))
    long_row = torch.cat((gates, ups)).view(1, -1).to(dtype)
    sixteens = torch.cat((gates.view(-1, 16), ups.view(-1, 16)), dim=1).to(dtype)

    assert torch.equal(backend.silu_and_mul(long_row).view(-1, 16), backend.silu_and_mul(sixteens))


@DTYPES
def test_silu_and_mul_of_gates_far_below_zero(backend: CpuBackend, dtype: torch.dtype) -> None:
    """A gate below -88.7 overflows exp(-gate): silu is -0 to the precision of float32, not NaN (as
    -ffast-math's division by infinity made it), and a large positive gate passes through."""
    gates = torch.tensor([-1e30, -3e4, -200.0, -90.5, -88.0, -20.0, 0.0, 20.0, 90.5, 3e4])
    x = torch.cat((gates, torch.full_like(gates, 3.0))).view(1, -1).to(dtype)

    out = backend.silu_and_mul(x)

    torch.testing.assert_close(out, REFERENCE.silu_and_mul(x), atol=1e-30, rtol=CLOSE[dtype]["rtol"])


def test_other_dtypes_take_the_reference(backend: CpuBackend) -> None:
    """float16, which the C++ ops do not take, against float64 math on the same inputs, within float16's
    rounding: the reference's own output would compare equal to itself, right or wrong."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 128, generator=gen).to(torch.float16)
    weight, bias = (
        torch.randn(5, 64, generator=gen).to(torch.float16),
        torch.randn(5, generator=gen).to(torch.float16),
    )
    gate, up = x.double().chunk(2, dim=-1)

    out, projected = backend.silu_and_mul(x), backend.linear(x[:, :64], weight, bias)

    assert out.dtype == projected.dtype == torch.float16
    fp16 = {"rtol": 2e-3, "atol": 2e-3}  # a few of float16's roundings (2^-11 apart), near zero too
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, **fp16)
    expected = x[:, :64].double() @ weight.double().T + bias.double()
    torch.testing.assert_close(projected.double(), expected, **fp16)


def quantized(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """weight as int8 or float8 (e4m3) with a scale a row, from the largest value each kind holds."""
    most = 127.0 if kind == "int8" else 448.0
    scale = weight.abs().amax(dim=1) / most
    scaled = weight / scale[:, None]
    data = scaled.round().to(torch.int8) if kind == "int8" else scaled.to(torch.float8_e4m3fn)
    return QuantizedWeight(data, scale)


def rounds_x_to_int8(weight: Weight) -> bool:
    """Whether the CPU backend rounds x per row to int8 against this weight: an int8 weight packed for
    vpdpbusd (W8A8)."""
    return isinstance(weight, PackedWeight) and weight.sums is not None


def as_multiplied(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x as the CPU backend multiplies it by weight: rounded per row to int8 against an int8 weight packed
    for vpdpbusd (int8_rows); as it is against any other, in float32."""
    return int8_rows(x) if rounds_x_to_int8(weight) else x.float()


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded per row to int8, in float32: x * (127 / max |x|) to nearest even, as vcvtps2dq does,
    times max |x| * (1 / 127). The kernel's own float32 operations, so that the same ties round the same
    way."""
    wide = x.float()
    top = wide.abs().amax(dim=1, keepdim=True)
    some = top > 0
    scale = torch.where(some, top * torch.tensor(1 / 127, dtype=torch.float32), 1.0)
    inverse = torch.full_like(top, 127) / top  # a division (torch's 127 / top is 127 * reciprocal(top))
    return torch.round(wide * torch.where(some, inverse, 1.0)) * scale


WEIGHTS = ["float32", "bfloat16", "int8-float32", "int8-bfloat16", "float8-float32", "float8-bfloat16"]


def linear_case(
    gen: torch.Generator, rows: int, n: int, k: int, weights: str
) -> tuple[torch.Tensor, Weight, torch.Tensor]:
    """x [rows, k] (a strided view) and a weight [n, k] of the kind named: its dtype, or its 8-bit kind and
    x's dtype; and a bias [n] in x's dtype."""
    kind, _, x_dtype = weights.rpartition("-")
    dtype = getattr(torch, x_dtype)
    x = padded_rows(gen, rows, k, dtype)
    weight = torch.randn(n, k, generator=gen)
    return x, quantized(weight, kind) if kind else weight.to(dtype), torch.randn(n, generator=gen).to(dtype)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (7, 100), (4099, 64), (576, 1536)], ids=str)
def test_skinny_linear(backends: list[CpuBackend], rows: int, n: int, k: int, weights: str) -> None:
    """Every block shape (rows and W rows not multiples of 4, K not a multiple of the vector width), each
    kind of weight, as given and as each backend prepares it at load: the sums in float32, rounded once to
    x's dtype."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x, weight, bias = linear_case(gen, rows, n, k, weights)

    compared = 0
    for backend, b in itertools.product(backends, (None, bias)):
        prepared = backend.prepare_linear(weight, x.dtype)
        if rounds_x_to_int8(prepared):  # int8 x int8: against its reference, below
            continue
        out = backend.linear(x, weight, b)
        torch.testing.assert_close(
            backend.linear(x, prepared, b).float(), out.float(), rtol=2**-7, atol=2**-7 * k**0.5
        )
        assert out.shape == (rows, n) and out.dtype == x.dtype and not out.isnan().any()
        wide = weight if isinstance(weight, QuantizedWeight) else weight.float()
        expected = REFERENCE.linear(x.float(), wide, None if b is None else b.float())
        if x.dtype == torch.bfloat16:  # the reference's bfloat16 GEMM sums in its own order
            torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=2**-7 * k**0.5)
        else:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        compared += 1
    # The backend that packs no weight for vpdpbusd (the first, or all where it does not run) is compared.
    assert compared >= 2, "no backend's product was compared with the reference"


@pytest.mark.parametrize("weights", [w for w in WEIGHTS if "-" in w])
@pytest.mark.parametrize("rows", [17, QUANTIZED_SKINNY_ROWS, QUANTIZED_SKINNY_ROWS + 1])
def test_quantized_weights_past_the_few_rows(backends: list[CpuBackend], rows: int, weights: str) -> None:
    """More rows than a decode step: still the few-row GEMM up to QUANTIZED_SKINNY_ROWS, MKL past it (but
    for int8 against bfloat16 rows through vdpbf16ps, which takes any number)."""
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = linear_case(gen, rows, 300, 200, weights)
    close = (
        {"rtol": 1e-4, "atol": 1e-4}
        if x.dtype == torch.float32
        else {"rtol": 2**-7, "atol": 2**-7 * 200**0.5}
    )
    for backend in backends:
        for prepared in (weight, backend.prepare_linear(weight, x.dtype)):
            out = backend.linear(x, prepared, bias)
            expected = REFERENCE.linear(as_multiplied(x, prepared), weight, bias.float()).to(x.dtype)
            torch.testing.assert_close(out.float(), expected.float(), **close)


@pytest.mark.parametrize("weights", ["bfloat16", "int8-bfloat16", "int8-float32"])
@pytest.mark.parametrize("rows", [1, 2, 11, 12, 13, 47, 48, 49, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (33, 4), (4099, 64), (7, 1536)], ids=str)
def test_packed_linear(backends: list[CpuBackend], rows: int, n: int, k: int, weights: str) -> None:
    """A weight packed for packed_linear.cpp, where this CPU runs its instructions (packed_runs): rows in
    tiles of 12 and stretches of 48 and not, outputs in groups of 32 and not, against the float32 product of
    x as it is multiplied; unpacked, the weight is the one it was. At load, bfloat16 weights are packed only
    where AMX does not run oneDNN's GEMM; a bfloat16 weight under float32 rows is not."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x, weight, bias = linear_case(gen, rows, n, k, weights)
    found = cpu_features()
    int8 = isinstance(weight, QuantizedWeight)
    runs = packed_runs(found, weight, x.dtype)
    packed_at_load = runs and (int8 or not found.amx_bf16.usable)
    for backend in backends:
        prepared = backend.prepare_linear(weight, x.dtype)
        assert isinstance(prepared, PackedWeight) == (packed_at_load and backend is backends[-1])
        if not int8:
            assert backend.prepare_linear(weight, torch.float32) is weight  # float32 rows take [N, K] paths
        if not runs or backend is not backends[-1]:
            continue
        packed = pack_linear(weight)  # the kernel, also where AMX keeps bfloat16 weights [N, K] at load
        assert (packed.sums is not None) == int8
        assert packed.shape == (n, k)
        unpacked = packed.unpacked()
        assert torch.equal(
            unpacked.data if isinstance(unpacked, QuantizedWeight) else unpacked,
            weight.data if isinstance(weight, QuantizedWeight) else weight,
        )
        wide = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight.float()
        for b in (None, bias):
            out = backend.linear(x, packed, b)
            assert out.shape == (rows, n) and out.dtype == x.dtype
            expected = REFERENCE.linear(as_multiplied(x, packed), wide, None if b is None else b.float())
            # float32 outputs: the sums are exact in int32, then two float32 products and the bias
            close = (2**-7, 2**-7 * k**0.5) if x.dtype == torch.bfloat16 else (1e-5, 1e-5 * k**0.5)
            torch.testing.assert_close(out.float(), expected, rtol=close[0], atol=close[1])
            # A row's product is the same bits alone (a decode of one sequence) as among any number of rows.
            for row in (0, rows - 1):
                assert torch.equal(backend.linear(x[row : row + 1], packed, b), out[row : row + 1])


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 47, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (33, 3), (4099, 64), (7, 1536), (40, 100)], ids=str)
def test_packed_float_linear(backend: CpuBackend, rows: int, n: int, k: int) -> None:
    """A float32 model's weights are packed at load for packed_float.cpp: rows in tiles (6 with AVX2, 12 with
    AVX-512) and not, outputs in whole groups and not, any K, against the reference's float32 product;
    unpacked, the weight is the one it was."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x, weight, bias = linear_case(gen, rows, n, k, "float32")
    packed = backend.prepare_linear(weight, torch.float32)
    assert isinstance(packed, PackedWeight) and packed.shape == (n, k)
    assert packed.data.shape[2] == cpu_ops().packed_float_group()
    assert torch.equal(packed.unpacked(), weight)
    for b in (None, bias):
        out = backend.linear(x, packed, b)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        torch.testing.assert_close(out, REFERENCE.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_packed_float_linear_refuses_what_it_cannot_multiply(backend: CpuBackend) -> None:
    ops = cpu_ops()
    packed = backend.prepare_linear(torch.randn(40, 64), torch.float32)
    assert isinstance(packed, PackedWeight)
    with pytest.raises(ValueError, match="packed must be"):
        ops.packed_float_linear(torch.randn(3, 65), packed.data, None, 40, False)  # another K
    with pytest.raises(ValueError, match="packed must be"):
        ops.packed_float_linear(torch.randn(3, 64), packed.data, None, 80, False)  # more rows than it holds
    with pytest.raises(ValueError, match="bias"):
        ops.packed_float_linear(torch.randn(3, 64), packed.data, torch.randn(41), 40, False)
    with pytest.raises((ValueError, TypeError), match="x"):
        ops.packed_float_linear(torch.randn(3, 64).bfloat16(), packed.data, None, 40, False)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [17, 31, 32, 33, 100, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (33, 64), (4099, 128), (7, 1536), (40, 100)], ids=str)
def test_int8_products_past_the_few_rows_match_the_reference_and_equal_on_amx_tiles(
    backends: list[CpuBackend], rows: int, n: int, k: int, x_dtype: torch.dtype
) -> None:
    """Past AMX_INT8_SKINNY_ROWS rows an int8 x int8 product runs on vpdpbusd, or on AMX's tiles where this
    CPU runs them (and K is a multiple of 64): the product of x rounded per row to int8, for rows in blocks
    of 32 and not, outputs in groups of 32 and not, K of one step of 64 and many, rows of a bfloat16 model
    and of a float32 one. The int32 sums are exact either way, so where the tiles run their outputs equal
    vpdpbusd's bit for bit; where they do not (no AMX-INT8 here), only the vpdpbusd path is checked."""
    found = cpu_features()
    _, weight, bias = linear_case(torch.Generator().manual_seed(rows + n + k), rows, n, k, "int8-bfloat16")
    prepared = backends[-1].prepare_linear(weight, x_dtype)
    if not packed_runs(found, weight, x_dtype):  # no int8 x int8 products here at all
        assert not isinstance(prepared, PackedWeight)
        return
    assert isinstance(prepared, PackedWeight) and rows > AMX_INT8_SKINNY_ROWS
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(x_dtype)
    close = (
        {"rtol": 1e-4, "atol": 1e-4} if x_dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7 * k**0.5}
    )
    ops = cpu_ops()
    for b in (None, bias.float()):
        args = (x, prepared.data, prepared.scale, prepared.sums, b, n)
        dots = ops.packed_linear(*args, False, False)
        expected = REFERENCE.linear(int8_rows(x), weight, b).to(x_dtype)
        torch.testing.assert_close(dots.float(), expected.float(), **close)
        if found.amx_int8.usable:  # the tiles are asked for (the op raises if they are refused)
            assert torch.equal(ops.packed_linear(*args, True, False), dots)
        # The backend takes the tiles where the probe ran AMX-INT8, vpdpbusd elsewhere.
        assert torch.equal(backends[-1].linear(x, prepared, b), dots)


@pytest.mark.parametrize("weights", ["bfloat16", "int8-bfloat16", "int8-float32"])
@pytest.mark.parametrize("rows", [1, 2, 12, 13, 16, 17, 32, 49, 100, 300])
@pytest.mark.parametrize(("inner", "k"), [(1536, 576), (32, 64), (96, 128), (40, 64)], ids=str)
def test_a_gated_product_is_silu_and_mul_of_the_product(
    backends: list[CpuBackend], rows: int, inner: int, k: int, weights: str
) -> None:
    """gated_linear on a packed gate and up projection [2 I, K] writes silu(gate) * up in the GEMM's pass
    (on vdpbf16ps, vpdpbusd or AMX's tiles, as the rows go): equal, bit for bit, to silu_and_mul of the
    plain product, which stores the gate and up in x's dtype first; with and without a bias, for rows in
    tiles, stretches and AMX blocks and not. An I that is not whole groups of 32, or a CPU that does not run
    the kernel, takes the two ops."""
    gen = torch.Generator().manual_seed(rows * inner + k)
    x, weight, bias = linear_case(gen, rows, 2 * inner, k, weights)
    runs = packed_runs(cpu_features(), weight, x.dtype)
    backend = backends[-1]  # packed, where this CPU runs the kernel (also a bfloat16 weight AMX leaves)
    prepared = pack_linear(weight) if runs else backend.prepare_linear(weight, x.dtype)
    for b in (None, bias.float()):
        fused = backend.gated_linear(x, prepared, b)
        assert fused.shape == (rows, inner)
        assert torch.equal(fused, backend.silu_and_mul(backend.linear(x, prepared, b)))


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 7, 12, 13, 47, 300])
@pytest.mark.parametrize(("inner", "k"), [(1536, 576), (32, 64), (96, 100), (40, 64)], ids=str)
def test_a_float32_gated_product_is_silu_and_mul_of_the_product(
    backend: CpuBackend, rows: int, inner: int, k: int
) -> None:
    """packed_float.cpp's gated form writes silu(gate) * up of a float32 gate and up projection: equal, bit
    for bit, to silu_and_mul of the plain packed product and close to the reference's, with and without a
    bias, for rows in tiles and not, with the next groups asked for (4 rows and more) and not. An I that is
    not whole groups (96 with AVX-512's 32, 40 with either) is refused by the kernel, and gated_linear takes
    the two ops."""
    gen = torch.Generator().manual_seed(rows * inner + k)
    x, weight, bias = linear_case(gen, rows, 2 * inner, k, "float32")
    packed = backend.prepare_linear(weight, torch.float32)
    assert isinstance(packed, PackedWeight)
    whole = inner % cpu_ops().packed_float_group() == 0
    for b in (None, bias):
        fused = backend.gated_linear(x, packed, b)
        assert fused.shape == (rows, inner)
        assert torch.equal(fused, backend.silu_and_mul(backend.linear(x, packed, b)))
        expected = REFERENCE.silu_and_mul(REFERENCE.linear(x, weight, b))
        # Each sum is about 24 in size here, so the product carries either sum's rounding 24 times over.
        torch.testing.assert_close(fused, expected, rtol=1e-4, atol=5e-3)
        if whole:
            assert torch.equal(cpu_ops().packed_float_linear(x, packed.data, b, packed.rows, True), fused)
        else:
            with pytest.raises(ValueError, match="gate and up rows must each be a multiple of"):
                cpu_ops().packed_float_linear(x, packed.data, b, packed.rows, True)


def test_int8_on_a_cpu_with_vnni_and_no_bfloat16_arithmetic(backends: list[CpuBackend]) -> None:
    """Where vpdpbusd runs and vdpbf16ps does not (a Cascade Lake or Ice Lake Xeon), a float32 model's int8
    weights are packed and its rows rounded to int8 (W8A8), the same kernel and outputs as where both run; a
    bfloat16 model's stay [N, K], weight-only, since packed_linear.cpp stores bfloat16 with vcvtneps2bf16."""
    found = cpu_features()
    if not found.avx512_vnni.usable:
        pytest.skip("vpdpbusd does not run here")
    withheld = {name: Feature(name, False, f"no {name}") for name in ("avx512_bf16", "amx_bf16", "amx_int8")}
    vnni_only = CpuBackend(cpu_ops(), dataclasses.replace(found, **withheld))
    x, weight, bias = linear_case(torch.Generator().manual_seed(5), 13, 100, 64, "int8-float32")
    packed = vnni_only.prepare_linear(weight, torch.float32)
    assert isinstance(packed, PackedWeight) and packed.sums is not None
    assert vnni_only.prepare_linear(weight, torch.bfloat16) is weight
    out = vnni_only.linear(x, packed, bias)
    assert out.dtype == torch.float32
    assert torch.equal(out, backends[-1].linear(x, backends[-1].prepare_linear(weight, torch.float32), bias))
    expected = REFERENCE.linear(int8_rows(x), weight.dequantize(), bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def instructions(library: str) -> dict[str, list[str]]:
    """Each function's instruction mnemonics in library, by its name as objdump demangles it (the OpenMP
    outlined parts keep their mangled names)."""
    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", library], capture_output=True, text=True, check=True
    ).stdout
    functions: dict[str, list[str]] = {}
    name = ""
    for line in listing.splitlines():
        if header := re.match(r"[0-9a-f]+ <(.*)>:$", line):
            name = header.group(1)
            functions[name] = []
        elif name and (code := re.match(r"\s+[0-9a-f]+:\s+(\S+)", line)):
            functions[name].append(code.group(1))
    return functions


# packed_linear.cpp's code for float32 x (the int8 path of a float32 model), and its bfloat16 twins. The
# OpenMP parts outlined from quantize_rows keep their mangled names: quantize_rows<float> is "IfE" there.
FLOAT32_INT8 = ("Int8Dot, float>", "run_amx<float>", "Store<float>", "Gates<float>", "quantize_rowsIfE")
BFLOAT16_OUT = ("Int8Dot, c10::BFloat16>", "Store<c10::BFloat16>", "Gates<c10::BFloat16>")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump here")
def test_the_float32_int8_path_holds_no_bfloat16_instruction() -> None:
    """The kernels' template instantiations for float32 x compile under the same target as their bfloat16
    twins (AVX512-BF16 on): none may hold a bfloat16 instruction, which would fault on a CPU with VNNI and
    no AVX512-BF16, where these tests do not run. The scan finds the kernel's own instructions in them
    (vpdpbusd's products, vpmovusdb's int8 rows), and bfloat16 ones in the twins, so it sees the code it
    checks. (It reads the build this CPU loads: an AVX2 machine's x86-64-v3 build holds the same
    target-attributed functions.)"""
    functions = instructions(cpu_ops().__file__)
    float32_ops: set[str] = set()
    for names, bf16_held in ((FLOAT32_INT8, False), (BFLOAT16_OUT, True)):
        for part in names:
            found = {name: code for name, code in functions.items() if part in name}
            assert found, f"no function of {part} in the build"
            held = sorted({op for code in found.values() for op in code if "bf16" in op})
            assert bool(held) == bf16_held, f"{part}: {held}"
            if not bf16_held:
                float32_ops.update(op for code in found.values() for op in code)
    assert {"vpdpbusd", "vpmovusdb"} <= float32_ops


def test_a_weight_of_odd_width_is_not_packed(backends: list[CpuBackend]) -> None:
    """vdpbf16ps takes pairs of k: a weight with an odd K stays [N, K] (for skinny_linear or oneDNN)."""
    _, weight, _ = linear_case(torch.Generator().manual_seed(3), 5, 40, 65, "bfloat16")
    for backend in backends:
        assert backend.prepare_linear(weight, torch.bfloat16) is weight


def test_packed_linear_refuses_what_it_cannot_multiply(backend: CpuBackend) -> None:
    """Each operand the kernel reads is checked against the packing's shape before it runs: an int8 weight
    without its sums, sums with a bfloat16 weight, a K the packing's step does not divide, a packing of the
    wrong rank, a K past vpdpbusd's int32 range, float16 rows, float32 rows against a bfloat16 weight."""
    ops = cpu_ops()
    x = torch.randn(3, 64).bfloat16()
    fours = pack_linear(quantized(torch.randn(40, 64), "int8"))
    pairs = pack_linear(torch.randn(40, 64).bfloat16())
    with pytest.raises(ValueError, match="x must be float32 or bfloat16, not float16"):
        ops.packed_linear(x.half(), fours.data, fours.scale, fours.sums, None, 40, False, False)
    with pytest.raises(ValueError, match="a packed bfloat16 weight takes bfloat16 x, not float"):
        ops.packed_linear(x.float(), pairs.data, None, None, None, 40, False, False)
    with pytest.raises(ValueError, match="an int8 weight needs its scale and its sums"):
        ops.packed_linear(x, fours.data, fours.scale, None, None, 40, False, False)
    with pytest.raises(ValueError, match="a scale and sums go with an int8 weight only"):
        ops.packed_linear(x, pairs.data, None, fours.sums, None, 40, False, False)
    with pytest.raises(ValueError, match="int8 weight needs N > 0 and K a multiple of 4, not N 40 and K 66"):
        ops.packed_linear(
            torch.randn(3, 66).bfloat16(), fours.data, fours.scale, fours.sums, None, 40, False, False
        )
    with pytest.raises(ValueError, match="packed must be"):
        ops.packed_linear(x, fours.data[0], fours.scale, fours.sums, None, 40, False, False)
    with pytest.raises(ValueError, match="gate and up rows must each be a multiple of 32, not 40 rows"):
        ops.packed_linear(x, fours.data, fours.scale, fours.sums, None, 40, False, True)
    wide = pack_linear(QuantizedWeight(torch.ones(32, 1 << 16, dtype=torch.int8), torch.ones(32)))
    with pytest.raises(ValueError, match="K below 65536"):
        ops.packed_linear(
            torch.ones(1, 1 << 16).bfloat16(), wide.data, wide.scale, wide.sums, None, 32, False, False
        )


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("weights", ["bfloat16", "int8-bfloat16", "int8-float32", "float32"])
def test_no_rows_give_an_empty_product(weights: str, gated: bool) -> None:
    """A step whose rows all belong to a prompt still being prefilled samples none, so it asks the
    vocabulary projection for no rows: each packed kernel returns an empty product (packed_linear.cpp once
    divided by its zero rows, and the worker died of SIGFPE)."""
    _, weight, _ = linear_case(torch.Generator().manual_seed(0), 1, 64, 64, weights)
    x = torch.zeros(0, 64, dtype=getattr(torch, weights.rpartition("-")[2]))
    ops = cpu_ops()
    if weights == "float32":
        packed = pack_linear(weight, ops.packed_float_group())
        y = ops.packed_float_linear(x, packed.data, None, 64, gated)
    else:
        packed = pack_linear(weight)
        y = ops.packed_linear(x, packed.data, packed.scale, packed.sums, None, 64, False, gated)
    assert y.shape == (0, 32 if gated else 64) and y.dtype == x.dtype


def test_every_float8_value_widens_exactly(backend: CpuBackend) -> None:
    """All 254 finite e4m3 values, denormals included, through the GEMM as one column each: each output is
    its value times one."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values = values[~values.float().isnan()]
    weight = QuantizedWeight(values[:, None].expand(-1, 8).contiguous(), torch.ones(len(values)))
    x = torch.zeros(1, 8)
    x[0, 3] = 1.0
    assert torch.equal(backend.linear(x, weight)[0], values.float())
