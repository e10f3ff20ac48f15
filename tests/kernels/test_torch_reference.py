"""TorchBackend, the torch reference kernels, against straightforward float64 implementations written here.

Every input is fresh random data from a seeded generator. The pool is filled with random values (never
zeros), each sequence owns random distinct pages (never the null page 0), and the references read K and V
slot by slot through the block tables. Where a slot must not be read, or must be overwritten before it is
read, it holds NaN.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels import TorchBackend
from kernels.torch_ref import GROUP_COST_SLOTS, group_by_length
from services.worker.models.llama import rotary_table
from tests.kernels.steps import Chunk, llama_spec, make_metadata

PAGE_SIZES = (8, 16, 32)
HEAD_DIMS = (16, 64, 128)
GROUPS = (1, 3, 4)  # query heads per KV head
DTYPES = (torch.float32, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of the expected output's scale
KV_HEADS = 2
NUM_PAGES = 40  # page 0 is the null page; every test leaves some pages unowned
EPS = 1e-6
BACKEND = TorchBackend()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


ATTENTION_CASES = list(itertools.product(PAGE_SIZES, HEAD_DIMS, GROUPS, DTYPES))
ATTENTION_IDS = [f"B{b}-D{d}-G{g}-{dtype_name(t)}" for b, d, g, t in ATTENTION_CASES]


# Inputs -------------------------------------------------------------------------------------------------


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Sequence[int] | range, scale: float
) -> torch.Tensor:
    """q [n, Hq, D] at these positions, k and v [L, Hkv, D]: each query attends to keys 0..its position.

    Query head h reads KV head h // (Hq / Hkv). Returns float64 [n, Hq, D].
    """
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, position in enumerate(positions):
        scores = torch.einsum("hd,lhd->hl", q[i], k[: position + 1]) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v[: position + 1])
    return out


def chunk_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv_before: torch.Tensor,
    chunks: Sequence[Chunk],
    scale: float,
) -> torch.Tensor:
    """Each chunk's attention over its prefix, read from the pool as it was before the step, and over the
    new K and V it brings (rows of q, k_new, v_new in chunk order)."""
    outputs, row = [], 0
    for chunk in chunks:
        rows = slice(row, row + chunk.count)
        k_prefix, v_prefix = gather_kv(kv_before, chunk.pages, chunk.start)
        k = torch.cat((k_prefix, k_new[rows].double()))
        v = torch.cat((v_prefix, v_new[rows].double()))
        outputs.append(attention_reference(q[rows], k, v, chunk.positions, scale))
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


# write_kv -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_write_kv_places_each_token_in_its_slot(page_size: int, head_dim: int, dtype: torch.dtype) -> None:
    gen = generator(1)
    pool = random_pool(gen, page_size, head_dim, dtype, layers=2)
    tokens = 2 * page_size + 5
    slots = torch.randperm((NUM_PAGES - 1) * page_size, generator=gen)[:tokens] + page_size  # not page 0
    _, k, v = fused_qkv(gen, tokens, 3 * KV_HEADS, head_dim, dtype)
    flat = pool.view(2, 2, -1, KV_HEADS, head_dim)  # [layers, 2, P * B, Hkv, D]
    flat[1, :, slots] = float("nan")  # every target slot must be overwritten
    before = pool.clone()

    BACKEND.write_kv(pool[1], k, v, slots)

    for token, slot in enumerate(slots.tolist()):
        assert torch.equal(flat[1, 0, slot], k[token]), f"K of token {token} at slot {slot}"
        assert torch.equal(flat[1, 1, slot], v[token]), f"V of token {token} at slot {slot}"
    untouched = torch.ones(flat.shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[1][:, untouched], before.view_as(flat)[1][:, untouched])
    assert torch.equal(pool[0], before[0]), "another layer changed"


# DecodeGraphs pads every captured batch with slot -1 and relies on write_kv skipping those rows, as
# cuda_ops.kv_write does.
def test_write_kv_skips_negative_slots() -> None:
    gen = generator(2)
    pool = random_pool(gen, 16, 64, torch.float32)[0]
    _, k, v = fused_qkv(gen, 3, KV_HEADS, 64, torch.float32)
    before = pool.clone()
    BACKEND.write_kv(pool, k, v, _long([5 * 16 + 3, -1, -1]))
    flat, flat_before = pool.view(2, -1, KV_HEADS, 64), before.view(2, -1, KV_HEADS, 64)
    assert torch.equal(flat[0, 5 * 16 + 3], k[0])
    flat_before[:, 5 * 16 + 3] = flat[:, 5 * 16 + 3]
    assert torch.equal(pool, before), "a padding row (slot -1) was written"


# Attention ----------------------------------------------------------------------------------------------


def check_decodes(
    gen: torch.Generator, lengths: list[int], page_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """Decode attention for sequences of these lengths, each row against the reference."""
    tables = random_tables(gen, lengths, page_size)
    kv_layer = random_pool(gen, page_size, head_dim, dtype)[0]
    poison_pages(kv_layer, unowned_pages(tables))
    q, _, _ = fused_qkv(gen, len(lengths), group * KV_HEADS, head_dim, dtype)
    decodes = [Chunk(table, n - 1, 1) for table, n in zip(tables, lengths, strict=True)]
    scale = head_dim**-0.5

    out = BACKEND.paged_attention(q, kv_layer, make_metadata(decodes, [], page_size), scale)

    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        k, v = gather_kv(kv_layer, table, n)
        expected = attention_reference(q[i : i + 1], k, v, [n - 1], scale)
        assert_close(out[i : i + 1], expected, dtype, f"sequence {i} of length {n}")


@pytest.mark.parametrize(("page_size", "head_dim", "group", "dtype"), ATTENTION_CASES, ids=ATTENTION_IDS)
def test_decode_attention(page_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    lengths = [2 * page_size + 3, 1, 3 * page_size, page_size]  # page boundaries, a single token
    check_decodes(generator(3), lengths, page_size, head_dim, group, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_decode_attention_over_lengths_far_apart(dtype: torch.dtype) -> None:
    """Decodes of very different lengths run in separate groups on the CPU; each row still gets its own."""
    page_size = 8
    lengths = [1, 30 * page_size + 3, 2 * page_size - 1, page_size]
    assert len(group_by_length(lengths, page_size, GROUP_COST_SLOTS)) > 1
    check_decodes(generator(6), lengths, page_size, 64, 4, dtype)


def partitions(rows: list[int]) -> Iterator[list[list[int]]]:
    """Every way to split rows into groups."""
    if not rows:
        yield []
        return
    first, rest = rows[0], rows[1:]
    for split in partitions(rest):
        yield [[first], *split]
        for i in range(len(split)):
            yield [*split[:i], [first, *split[i]], *split[i + 1 :]]


@pytest.mark.parametrize("seed", range(40))
def test_decode_groups_cost_the_least_of_any_split(seed: int) -> None:
    gen = generator(seed)
    page_size, group_cost = 16, int(torch.randint(0, 600, (1,), generator=gen))
    lengths = torch.randint(1, 800, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()

    def cost(groups: list[list[int]]) -> int:
        padded = sum(len(g) * max(-(-lengths[i] // page_size) for i in g) * page_size for g in groups)
        return padded + group_cost * len(groups)

    groups = group_by_length(lengths, page_size, group_cost)

    assert sorted(row for g in groups for row in g) == list(range(len(lengths)))
    assert cost(groups) == min(cost(split) for split in partitions(list(range(len(lengths)))))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_attention_with_a_graph_bound(page_size: int, dtype: torch.dtype) -> None:
    """decode_max_len far past every length and every block table, as CUDA graphs set it."""
    gen = generator(4)
    head_dim, group = 64, 4
    lengths = [page_size + 1, 1, 2 * page_size]
    tables = random_tables(gen, lengths, page_size)
    kv_layer = random_pool(gen, page_size, head_dim, dtype)[0]
    poison_pages(kv_layer, unowned_pages(tables))
    q, _, _ = fused_qkv(gen, len(lengths), group * KV_HEADS, head_dim, dtype)
    decodes = [Chunk(table, n - 1, 1) for table, n in zip(tables, lengths, strict=True)]
    meta = make_metadata(decodes, [], page_size, decode_max_len=NUM_PAGES * page_size)
    scale = head_dim**-0.5

    out = BACKEND.paged_attention(q, kv_layer, meta, scale)

    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        k, v = gather_kv(kv_layer, table, n)
        assert_close(out[i : i + 1], attention_reference(q[i : i + 1], k, v, [n - 1], scale), dtype)


# Decode gathers whole pages up to decode_max_len: the slots past the end of a sequence's last page hold
# whatever an earlier owner of the page wrote. A non-finite value there must not reach the output (0 * NaN =
# NaN under a mere softmax mask): an fp16 overflow in one request would poison later, unrelated requests
# that reuse the page.
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_decode_attention_ignores_slots_past_the_end(dtype: torch.dtype) -> None:
    gen = generator(5)
    page_size, head_dim, group = 16, 64, 4
    lengths = [page_size + 5, 3 * page_size]  # the first row's table is padded with the null page
    tables = random_tables(gen, lengths, page_size)
    kv_layer = random_pool(gen, page_size, head_dim, dtype)[0]
    # The null page is never written (padding rows skip it), and pools start zeroed: it stays zero.
    kv_layer[:, 0] = 0.0
    poison_pages(kv_layer, unowned_pages(tables))
    poison_slots(kv_layer, tables[0], range(lengths[0], len(tables[0]) * page_size))
    q, _, _ = fused_qkv(gen, len(lengths), group * KV_HEADS, head_dim, dtype)
    decodes = [Chunk(table, n - 1, 1) for table, n in zip(tables, lengths, strict=True)]
    scale = head_dim**-0.5

    out = BACKEND.paged_attention(q, kv_layer, make_metadata(decodes, [], page_size), scale)

    k, v = gather_kv(kv_layer, tables[0], lengths[0])
    assert_close(out[:1], attention_reference(q[:1], k, v, [lengths[0] - 1], scale), dtype)


@pytest.mark.parametrize(("page_size", "head_dim", "group", "dtype"), ATTENTION_CASES, ids=ATTENTION_IDS)
def test_prefill_attention_over_a_cached_prefix(
    page_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    gen = generator(6)
    prefills = [(0, 2 * page_size + 3), (page_size, 5), (page_size + 5, page_size + 7)]  # (cached, new)
    tables = random_tables(gen, [start + count for start, count in prefills], page_size)
    chunks = [Chunk(table, start, count) for table, (start, count) in zip(tables, prefills, strict=True)]
    kv_layer = random_pool(gen, page_size, head_dim, dtype)[0]
    poison_pages(kv_layer, [0, *unowned_pages(tables)])
    for chunk in chunks:  # the new slots (written before they are read), and the rest of the last page
        poison_slots(kv_layer, chunk.pages, range(chunk.start, len(chunk.pages) * page_size))
    kv_before = kv_layer.clone()
    tokens = sum(chunk.count for chunk in chunks)
    q, k, v = fused_qkv(gen, tokens, group * KV_HEADS, head_dim, dtype)
    meta = make_metadata([], chunks, page_size)
    scale = head_dim**-0.5

    BACKEND.write_kv(kv_layer, k, v, meta.slot_mapping)  # as the model does: this step's KV first
    out = BACKEND.paged_attention(q, kv_layer, meta, scale)

    assert_close(out, chunk_reference(q, k, v, kv_before, chunks, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mixed_batch_of_decodes_and_prefill_chunks(page_size: int, group: int, dtype: torch.dtype) -> None:
    gen = generator(7)
    head_dim = 64
    decode_lengths = [page_size, 1, 2 * page_size + 3]
    prefills = [(0, page_size + 3), (2 * page_size, 7)]  # (cached, new)
    lengths = decode_lengths + [start + count for start, count in prefills]
    tables = random_tables(gen, lengths, page_size)
    decodes = [Chunk(table, n - 1, 1) for table, n in zip(tables[:3], decode_lengths, strict=True)]
    chunks = [Chunk(table, start, count) for table, (start, count) in zip(tables[3:], prefills, strict=True)]
    kv_layer = random_pool(gen, page_size, head_dim, dtype)[0]
    poison_pages(kv_layer, unowned_pages(tables))
    for chunk in decodes:
        poison_slots(kv_layer, chunk.pages, chunk.positions)
    for chunk in chunks:
        poison_slots(kv_layer, chunk.pages, range(chunk.start, len(chunk.pages) * page_size))
    kv_before = kv_layer.clone()
    tokens = len(decodes) + sum(chunk.count for chunk in chunks)
    q, k, v = fused_qkv(gen, tokens, group * KV_HEADS, head_dim, dtype)
    meta = make_metadata(decodes, chunks, page_size)
    scale = head_dim**-0.5

    BACKEND.write_kv(kv_layer, k, v, meta.slot_mapping)
    out = BACKEND.paged_attention(q, kv_layer, meta, scale)

    assert_close(out, chunk_reference(q, k, v, kv_before, [*decodes, *chunks], scale), dtype)


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
