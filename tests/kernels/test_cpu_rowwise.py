"""The C++ CPU row-wise ops (RMSNorm, rotary, SiLU and mul, the few-row GEMM) against the torch reference,
on fresh random float32 inputs. Inputs that are views of wider rows have NaN in the columns around them,
which an op that ignores a stride would read."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels.cpu_backend import CpuBackend, cpu_ops
from kernels.torch_ref import TorchBackend
from services.worker.models.decoder import rotary_table
from tests.kernels.steps import llama_spec

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
REFERENCE = TorchBackend()
PAD = 16
EPS = 1e-6


@pytest.fixture(scope="module")
def backend() -> CpuBackend:
    ops = cpu_ops()
    assert ops is not None, "a compiler is here, so the C++ ops must build"
    return CpuBackend(ops)


def padded_rows(gen: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """[rows, width] random values: a view into rows PAD wider on each side, which hold NaN."""
    buffer = torch.full((rows, width + 2 * PAD), float("nan"))
    buffer[:, PAD : PAD + width] = torch.randn(rows, width, generator=gen)
    return buffer[:, PAD : PAD + width]


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (40, 1000), (6, 9, 64), (5, 4, 128)], ids=str)
def test_rms_norm(backend: CpuBackend, shape: tuple[int, ...], with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + with_residual)
    x = padded_rows(gen, shape[0], torch.Size(shape[1:]).numel()).unflatten(1, shape[1:])
    weight = 1.0 + 0.2 * torch.randn(shape[-1], generator=gen)
    residual = torch.randn(shape, generator=gen) if with_residual else None
    x_before = x.clone()
    expected, expected_residual = REFERENCE.rms_norm(x, weight, EPS, residual)

    normed, new_residual = backend.rms_norm(x, weight, EPS, residual)

    assert normed.shape == shape and not normed.isnan().any()
    torch.testing.assert_close(normed, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(new_residual, expected_residual), "the new residual is not x + residual"
    assert torch.equal(x, x_before), "x changed"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_in_place(backend: CpuBackend, head_dim: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + tokens)
    spec = llama_spec(head_dim, max_positions=4096)
    cos_sin = rotary_table(spec, torch.device("cpu"), torch.float32)
    positions = torch.randint(0, spec.max_model_len, (tokens,), generator=gen)
    widths = [9 * head_dim, 3 * head_dim, 3 * head_dim]
    qkv = padded_rows(gen, tokens, sum(widths))
    q, k, v = (part.unflatten(1, (-1, head_dim)) for part in qkv.split(widths, dim=-1))
    expected_q, expected_k = REFERENCE.rotary(q.clone(), k.clone(), positions, cos_sin)
    v_before = v.clone()

    q_out, k_out = backend.rotary(q, k, positions, cos_sin)

    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "not in place"
    torch.testing.assert_close(q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, expected_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before), "V changed"


def test_rotary_refuses_a_position_past_its_table(backend: CpuBackend) -> None:
    cos_sin = torch.zeros(8, 2, 64)
    q, k = torch.zeros(2, 3, 64), torch.zeros(2, 1, 64)
    with pytest.raises(RuntimeError, match="past the rotary table"):
        backend.rotary(q, k, torch.tensor([3, 8]), cos_sin)


@pytest.mark.parametrize("inner", [64, 1536, 5632])
def test_silu_and_mul(backend: CpuBackend, inner: int) -> None:
    x = padded_rows(torch.Generator().manual_seed(inner), 9, 2 * inner)

    out = backend.silu_and_mul(x)

    assert out.shape == (9, inner) and out.is_contiguous()
    torch.testing.assert_close(out, REFERENCE.silu_and_mul(x), rtol=1e-5, atol=1e-5)


def test_other_dtypes_take_the_reference(backend: CpuBackend) -> None:
    """bfloat16, which the C++ ops do not take, against float64 math on the same inputs, within bfloat16's
    rounding: the reference's own output would compare equal to itself, right or wrong."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    weight, bias = (
        torch.randn(5, 64, generator=gen).to(torch.bfloat16),
        torch.randn(5, generator=gen).to(torch.bfloat16),
    )
    gate, up = x.double().chunk(2, dim=-1)

    out, projected = backend.silu_and_mul(x), backend.linear(x[:, :64], weight, bias)

    assert out.dtype == projected.dtype == torch.bfloat16
    bf16 = {"rtol": 1.6e-2, "atol": 1e-2}  # a few of bfloat16's roundings (2^-8 apart), near zero too
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, **bf16)
    expected = x[:, :64].double() @ weight.double().T + bias.double()
    torch.testing.assert_close(projected.double(), expected, **bf16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (7, 100), (4099, 64), (576, 1536)], ids=str)
def test_skinny_linear(backend: CpuBackend, rows: int, n: int, k: int) -> None:
    """Every block shape (rows and W rows not multiples of 4, K not a multiple of the vector width)."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x = padded_rows(gen, rows, k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)

    for b in (None, bias):
        out = backend.linear(x, weight, b)
        assert out.shape == (rows, n) and not out.isnan().any()
        torch.testing.assert_close(out, REFERENCE.linear(x, weight, b), rtol=1e-4, atol=1e-4)
