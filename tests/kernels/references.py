"""For the TorchBackend tests: seeded random inputs, and straightforward float64 implementations of the
reference kernels written here.

The pool is filled with random values (never zeros), each sequence owns random distinct pages (never the
null page 0), and the references read K and V slot by slot through the block tables. Where a slot must not
be read, or must be overwritten before it is read, the tests put NaN in it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from pagedserve.kernels.backend import LayerAttention
from pagedserve.kernels.torch_ref import TorchBackend
from tests.kernels.steps import Chunk, dtype_name

PAGE_SIZES = (8, 16, 32)
HEAD_DIMS = (16, 64, 128)
GROUPS = (1, 3, 4)  # query heads per KV head
DTYPES = (torch.float32, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of the expected output's scale
KV_HEADS = 2
NUM_PAGES = 40  # page 0 is the null page; every test leaves some pages unowned
EPS = 1e-6
BACKEND = TorchBackend()


ATTENTION_CASES = list(itertools.product(PAGE_SIZES, HEAD_DIMS, GROUPS, DTYPES))
ATTENTION_IDS = [f"B{b}-D{d}-G{g}-{dtype_name(t)}" for b, d, g, t in ATTENTION_CASES]


# Inputs -------------------------------------------------------------------------------------------------


def random_pool(
    gen: torch.Generator, page_size: int, head_dim: int, dtype: torch.dtype, layers: int = 1
) -> torch.Tensor:
    """A pool [layers, 2, P, B, Hkv, D] of random values."""
    shape = (layers, 2, NUM_PAGES, page_size, KV_HEADS, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def random_tables(gen: torch.Generator, lengths: Sequence[int], page_size: int) -> list[tuple[int, ...]]:
    """Block tables for sequences of these lengths: distinct pages in random order, never page 0."""
    order = (torch.randperm(NUM_PAGES - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for length in lengths:
        count = -(-length // page_size)
        tables.append(tuple(order[used : used + count]))
        used += count
    assert used <= len(order), "NUM_PAGES is too small for this test"
    return tables


def fused_qkv(
    gen: torch.Generator, tokens: int, q_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D]: non-contiguous views of one fused projection, as in the model."""
    widths = [q_heads * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim]
    qkv = torch.randn(tokens, sum(widths), generator=gen).to(dtype)
    q, k, v = qkv.split(widths, dim=-1)
    return (
        q.view(tokens, q_heads, head_dim),
        k.view(tokens, KV_HEADS, head_dim),
        v.view(tokens, KV_HEADS, head_dim),
    )


def _long(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def poison_slots(kv_layer: torch.Tensor, pages: Sequence[int], positions: Sequence[int] | range) -> None:
    """NaN into the K and V of these positions of a sequence whose block table is `pages`."""
    page_size = kv_layer.shape[2]
    for p in positions:
        kv_layer[:, pages[p // page_size], p % page_size] = float("nan")


def poison_pages(kv_layer: torch.Tensor, pages: Sequence[int]) -> None:
    kv_layer[:, list(pages)] = float("nan")


def varied_layers(gen: torch.Generator, scale: float, q_heads: int, window: int) -> dict[str, LayerAttention]:
    """A layer of each kind: windowed, softcapped (Gemma 2), with sinks (gpt-oss), and all three at once."""
    sinks = torch.randn(q_heads, generator=gen) * 2
    return {
        "window": LayerAttention(scale, window=window),
        "softcap": LayerAttention(scale, softcap=5.0),
        "sinks": LayerAttention(scale, sinks=sinks),
        "all": LayerAttention(scale, window=window, softcap=5.0, sinks=sinks),
    }


def null_before(pages: tuple[int, ...], first: int, page_size: int) -> tuple[int, ...]:
    """The block table with the null page for each page wholly before position `first`."""
    return tuple(0 if (i + 1) * page_size <= first else page for i, page in enumerate(pages))


def unowned_pages(tables: Sequence[Sequence[int]]) -> list[int]:
    """Every page but the null page and the ones in these block tables."""
    owned = {page for table in tables for page in table}
    return [page for page in range(1, NUM_PAGES) if page not in owned]


# References ---------------------------------------------------------------------------------------------


def gather_kv(kv_layer: torch.Tensor, pages: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a sequence's first `length` tokens, [length, Hkv, D] in float64, read slot by slot."""
    page_size = kv_layer.shape[2]
    page_of = _long([pages[t // page_size] for t in range(length)])
    offset = _long([t % page_size for t in range(length)])
    kv = kv_layer[:, page_of, offset].double()  # [2, length, Hkv, D]
    return kv[0], kv[1]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Sequence[int] | range,
    scale: float,
    layer: LayerAttention | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] at these positions, k and v [L, Hkv, D]: each query attends to keys 0..its position, or
    to the last layer.window of them; scores softcapped where layer.softcap, and each head's sink logit
    in the softmax's denominator where layer.sinks.

    Query head h reads KV head h // (Hq / Hkv). Returns float64 [n, Hq, D].
    """
    layer = layer or LayerAttention(scale)
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, position in enumerate(positions):
        first = max(0, position + 1 - layer.window) if layer.window else 0
        scores = torch.einsum("hd,lhd->hl", q[i], k[first : position + 1]) * scale
        if layer.softcap:
            scores = layer.softcap * torch.tanh(scores / layer.softcap)
        if layer.sinks is not None:
            scores = torch.cat((scores, layer.sinks.double()[:, None]), dim=1)
        weights = scores.softmax(dim=-1)[:, : position + 1 - first]
        out[i] = torch.einsum("hl,lhd->hd", weights, v[first : position + 1])
    return out


def chunk_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv_before: torch.Tensor,
    chunks: Sequence[Chunk],
    scale: float,
    layer: LayerAttention | None = None,
) -> torch.Tensor:
    """Each chunk's attention over its prefix, read from the pool as it was before the step, and over the
    new K and V it brings (rows of q, k_new, v_new in chunk order)."""
    outputs, row = [], 0
    for chunk in chunks:
        rows = slice(row, row + chunk.count)
        k_prefix, v_prefix = gather_kv(kv_before, chunk.pages, chunk.start)
        k = torch.cat((k_prefix, k_new[rows].double()))
        v = torch.cat((v_prefix, v_new[rows].double()))
        outputs.append(attention_reference(q[rows], k, v, chunk.positions, scale, layer))
        row += chunk.count
    return torch.cat(outputs)


def rotary_reference(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of x [T, H, D] by cos_sin [T, 2, D] (each position's row), in float64."""
    half = x.shape[-1] // 2
    x = x.double()
    cos, sin = cos_sin[:, 0, None].double(), cos_sin[:, 1, None].double()  # [T, 1, D]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat(
        (x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]), dim=-1
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Within TOLERANCE[dtype] of the expected values' scale (their largest magnitude, at least 1)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    has_nan = bool(actual.isnan().any())
    assert not has_nan, f"{what}: NaN in the output"
    scale = max(expected.abs().max().item(), 1.0)
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, (
        f"{what}: max error {error:.3g} > {TOLERANCE[dtype]} x {scale:.3g}"
    )
