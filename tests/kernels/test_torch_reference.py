"""TorchBackend's KV write and paged attention against straightforward float64 implementations
(tests/kernels/references.py).

Every input is fresh random data from a seeded generator. The pool is filled with random values (never
zeros), each sequence owns random distinct pages (never the null page 0), and the references read K and V
slot by slot through the block tables. Where a slot must not be read, or must be overwritten before it is
read, it holds NaN.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedserve.kernels.backend import LayerAttention
from pagedserve.kernels.torch_ref import GROUP_COST_SLOTS, group_by_length
from tests.kernels.references import (
    ATTENTION_CASES,
    ATTENTION_IDS,
    BACKEND,
    DTYPES,
    GROUPS,
    HEAD_DIMS,
    KV_HEADS,
    NUM_PAGES,
    PAGE_SIZES,
    _long,
    assert_close,
    attention_reference,
    chunk_reference,
    dtype_name,
    fused_qkv,
    gather_kv,
    null_before,
    poison_pages,
    poison_slots,
    random_pool,
    random_tables,
    unowned_pages,
    varied_layers,
)
from tests.kernels.steps import Chunk, generator, make_metadata

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

    out = BACKEND.paged_attention(q, kv_layer, make_metadata(decodes, [], page_size), LayerAttention(scale))

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

    out = BACKEND.paged_attention(q, kv_layer, meta, LayerAttention(scale))

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

    out = BACKEND.paged_attention(q, kv_layer, make_metadata(decodes, [], page_size), LayerAttention(scale))

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
    out = BACKEND.paged_attention(q, kv_layer, meta, LayerAttention(scale))

    assert_close(out, chunk_reference(q, k, v, kv_before, chunks, scale), dtype)


# (the model's dtype, the pool's): the pool may be narrower than the model (--kv-cache-dtype)
MIXED_DTYPES = [(dtype, dtype) for dtype in DTYPES] + [(torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("dtype", "kv_dtype"), MIXED_DTYPES, ids=lambda t: dtype_name(t))
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mixed_batch_of_decodes_and_prefill_chunks(
    page_size: int, group: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    """Decodes and prefill chunks in one step; where the pool is narrower than q, write_kv rounds this step's
    K and V to it, and the attention computes in q's dtype over the rounded values."""
    gen = generator(7)
    head_dim = 64
    decode_lengths = [page_size, 1, 2 * page_size + 3]
    prefills = [(0, page_size + 3), (2 * page_size, 7)]  # (cached, new)
    lengths = decode_lengths + [start + count for start, count in prefills]
    tables = random_tables(gen, lengths, page_size)
    decodes = [Chunk(table, n - 1, 1) for table, n in zip(tables[:3], decode_lengths, strict=True)]
    chunks = [Chunk(table, start, count) for table, (start, count) in zip(tables[3:], prefills, strict=True)]
    kv_layer = random_pool(gen, page_size, head_dim, kv_dtype)[0]
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
    out = BACKEND.paged_attention(q, kv_layer, meta, LayerAttention(scale))

    k, v = k.to(kv_dtype), v.to(kv_dtype)
    assert torch.equal(kv_layer.view(2, -1, KV_HEADS, head_dim)[0, meta.slot_mapping], k)
    assert out.dtype == dtype
    assert_close(out, chunk_reference(q, k, v, kv_before, [*decodes, *chunks], scale), dtype)


@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_windows_softcaps_and_sinks_in_a_mixed_batch(page_size: int, dtype: torch.dtype, kind: str) -> None:
    """Decodes and prefill chunks, some longer than the window, some over a cached prefix; the pages wholly
    before each sequence's window are the null page's, as the scheduler leaves them once it frees them."""
    gen = generator(8)
    head_dim, group, window = 64, 3, page_size + 5
    decode_lengths = [1, window, 3 * page_size + 2]
    prefills = [(0, 2 * page_size + 3), (2 * page_size + 1, 6)]  # (cached, new)
    lengths = decode_lengths + [start + count for start, count in prefills]
    tables = random_tables(gen, lengths, page_size)
    decodes = [Chunk(table, n - 1, 1) for table, n in zip(tables[:3], decode_lengths, strict=True)]
    chunks = [Chunk(table, start, count) for table, (start, count) in zip(tables[3:], prefills, strict=True)]
    kv_layer = random_pool(gen, page_size, head_dim, dtype)[0]
    kv_before = kv_layer.clone()
    tokens = len(decodes) + sum(chunk.count for chunk in chunks)
    q, k, v = fused_qkv(gen, tokens, group * KV_HEADS, head_dim, dtype)
    layer = varied_layers(gen, head_dim**-0.5, group * KV_HEADS, window)[kind]
    expected = chunk_reference(q, k, v, kv_before, [*decodes, *chunks], layer.scale, layer)
    if layer.window:  # gone before the window of the sequence's first query this step
        decodes = [Chunk(null_before(c.pages, c.start + 1 - window, page_size), c.start, 1) for c in decodes]
    meta = make_metadata(decodes, chunks, page_size)

    BACKEND.write_kv(kv_layer, k, v, meta.slot_mapping)
    out = BACKEND.paged_attention(q, kv_layer, meta, layer)

    assert_close(out, expected, dtype, kind)
