"""TorchBackend's row-wise kernels (RMSNorm, rotary, SiLU and mul) against straightforward float64
implementations (tests/kernels/references.py), and against transformers' Llama bit for bit.

Every input is fresh random data from a seeded generator.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from services.worker.models.decoder import rotary_table
from tests.kernels.references import (
    BACKEND,
    DTYPES,
    EPS,
    GROUPS,
    HEAD_DIMS,
    KV_HEADS,
    assert_close,
    dtype_name,
    fused_qkv,
    rotary_reference,
)
from tests.kernels.steps import generator, llama_spec

# RMSNorm ------------------------------------------------------------------------------------------------

NORM_SHAPES = [(7, 96), (5, 1000), (6, 4, 16), (3, 5, 128)]  # [T, H], and [T, heads, D] per-head norms


def norm_inputs(
    shape: tuple[int, ...], dtype: torch.dtype, with_residual: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = generator(8)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    return x, weight, residual


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, with_residual: bool) -> None:
    x, weight, residual = norm_inputs(shape, dtype, with_residual)
    summed = x if residual is None else x + residual
    x_before = x.clone()

    normed, new_residual = BACKEND.rms_norm(x, weight, EPS, residual)

    assert torch.equal(new_residual, summed), "the new residual must be x + residual"
    assert torch.equal(x, x_before), "x changed"
    # transformers' rounding: the norm in float, the normalized value in the model dtype, then the weight.
    s = summed.double()
    unit = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype).double()
    assert normed.dtype == dtype
    assert_close(normed, weight.double() * unit, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_rms_norm_is_transformers_bit_for_bit(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, weight, residual = norm_inputs(shape, dtype, with_residual=True)
    assert residual is not None
    module = LlamaRMSNorm(shape[-1], eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        expected = module(residual + x)

    normed, _ = BACKEND.rms_norm(x, weight, EPS, residual)

    assert torch.equal(normed, expected)


# Rotary -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rotary_table_holds_cos_and_sin_of_each_position(head_dim: int) -> None:
    spec = llama_spec(head_dim)
    table = rotary_table(spec, torch.device("cpu"), torch.float32)
    positions = torch.arange(spec.max_model_len, dtype=torch.float64)[:, None]
    pair = torch.arange(head_dim, dtype=torch.float64) % (head_dim // 2)  # both halves repeat the pairs
    angles = positions * 10000.0 ** (-2 * pair / head_dim)
    assert table.shape == (spec.max_model_len, 2, head_dim)
    # transformers rounds position x frequency to float32: an angle of up to 63 is off by up to ~4e-6.
    torch.testing.assert_close(table[:, 0].double(), angles.cos(), rtol=0, atol=2e-5)
    torch.testing.assert_close(table[:, 1].double(), angles.sin(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rotary(head_dim: int, group: int, dtype: torch.dtype) -> None:
    gen = generator(9)
    spec = llama_spec(head_dim)
    cos_sin = rotary_table(spec, torch.device("cpu"), dtype)
    tokens = 11
    positions = torch.randint(0, spec.max_model_len, (tokens,), generator=gen)  # any order, repeats too
    q, k, _ = fused_qkv(gen, tokens, group * KV_HEADS, head_dim, dtype)
    expected_q = rotary_reference(q, cos_sin[positions])
    expected_k = rotary_reference(k, cos_sin[positions])

    q_out, k_out = BACKEND.rotary(q, k, positions, cos_sin)

    assert q_out.dtype == k_out.dtype == dtype
    assert_close(q_out, expected_q, dtype, "q")
    assert_close(k_out, expected_k, dtype, "k")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_rotary_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    gen = generator(10)
    head_dim, tokens = 64, 9
    spec = llama_spec(head_dim)
    positions = torch.randint(0, spec.max_model_len, (tokens,), generator=gen)
    q, k, _ = fused_qkv(gen, tokens, 3 * KV_HEADS, head_dim, dtype)
    cos, sin = LlamaRotaryEmbedding(spec.hf_config)(q, positions[None])  # [1, T, D] each
    # transformers' layout is [batch, heads, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    q_out, k_out = BACKEND.rotary(q, k, positions, rotary_table(spec, torch.device("cpu"), dtype))

    assert torch.equal(q_out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_out, hf_k[0].transpose(0, 1))


# SiLU and mul -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", [16, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_silu_and_mul(dtype: torch.dtype, inner: int) -> None:
    gen = generator(11)
    x = (3 * torch.randn(6, 2 * inner, generator=gen)).to(dtype)
    gate, up = x.double()[:, :inner], x.double()[:, inner:]

    out = BACKEND.silu_and_mul(x)

    assert out.shape == (6, inner) and out.dtype == dtype
    assert_close(out, gate / (1 + torch.exp(-gate)) * up, dtype)
