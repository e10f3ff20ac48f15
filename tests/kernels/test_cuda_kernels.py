"""The CUDA kernels' KV write and paged attention (CupyBackend, and cuda_ops' typed wrappers) against
TorchBackend on the same device.

The attention tests keep two copies of a pool (tests/kernels/cases.py): the reference reads one that is
finite everywhere; the kernels read one where every slot they must not read holds NaN, and so does every
slot this step writes before reading it. Comparisons are in float32, against a tolerance of the expected
values' scale.

On a CUDA device with CuPy, else in the kernels' emulator (pagedserve/kernels/emulator.py) on the CPU. The
`backend` fixture is in tests/kernels/conftest.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.kernels import cuda_ops
from pagedserve.kernels.backend import LayerAttention
from pagedserve.kernels.cupy_backend import CupyBackend
from pagedserve.kernels.launch import EMULATED_RESIDENT_BLOCKS
from tests.kernels.cases import (
    ATTENTION_CASES,
    ATTENTION_IDS,
    DEVICE,
    DTYPES,
    GROUPS,
    HEAD_DIMS,
    KV_HEADS,
    NAN,
    OFFSETS,
    PAGE_SIZES,
    REFERENCE,
    assert_close,
    attention_case,
    dtype_name,
    fused_qkv,
    generator,
    randn,
    run_attention,
    same_bits,
)
from tests.kernels.references import varied_layers

pytestmark = pytest.mark.cuda_kernels  # on a GPU, else in the emulator on the CPU: tests/devices.py


# KV write -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@OFFSETS
def test_kv_write(
    backend: CupyBackend, dtype: torch.dtype, page_size: int, head_dim: int, offset: int
) -> None:
    gen = generator(1)
    num_pages, tokens = 24, 2 * page_size + 5
    pool = randn(gen, 2, 2, num_pages, page_size, KV_HEADS, head_dim, dtype=dtype)  # two layers
    slots = torch.randperm((num_pages - 1) * page_size, generator=gen)[:tokens] + page_size  # not page 0
    slots[::4] = -1  # padding rows, as in a CUDA graph's batch: skipped
    slots = slots.to(DEVICE)
    written = slots >= 0
    fused = fused_qkv(gen, tokens, 3 * KV_HEADS, head_dim, dtype, offset)
    pool.view(2, 2, -1, KV_HEADS, head_dim)[1, :, slots[written]] = NAN  # every target slot is overwritten
    expected = pool.clone()
    REFERENCE.write_kv(expected[1], fused.k[written], fused.v[written], slots[written])

    backend.write_kv(pool[1], fused.k, fused.v, slots)

    assert same_bits(pool, expected)


# Paged attention ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("page_size", "head_dim", "group", "dtype"), ATTENTION_CASES, ids=ATTENTION_IDS)
def test_paged_decode(
    backend: CupyBackend, page_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """Sequences of different lengths within one partition: page boundaries, a single token."""
    lengths = [2 * page_size + 3, 1, 3 * page_size, page_size, 100]
    case = attention_case(2, lengths, [], page_size, head_dim, group, dtype)
    assert case.meta.decode_max_len < 2 * backend.tuning.min_partition  # too short to split

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize(("page_size", "head_dim", "group", "dtype"), ATTENTION_CASES, ids=ATTENTION_IDS)
def test_paged_decode_split_k(
    backend: CupyBackend, page_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """Long and short sequences in one batch: several partitions each, merged by the second kernel."""
    part = backend.tuning.min_partition
    lengths = [2 * part + 37, 1, part, page_size + 3, part + 1, 3 * part]
    case = attention_case(3, lengths, [], page_size, head_dim, group, dtype)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_paged_decode_of_a_batch_that_fills_the_device(backend: CupyBackend, dtype: torch.dtype) -> None:
    """Enough sequences to fill the emulator's device alone (launch.EMULATED_RESIDENT_BLOCKS in the kernels):
    long contexts in one partition each (on a GPU the same batch is split, and must agree all the same)."""
    part = backend.tuning.min_partition
    seqs = EMULATED_RESIDENT_BLOCKS  # x KV_HEADS blocks: the waves the split aims at, and more
    lengths = [3 * part + 5 * i for i in range(seqs)]
    case = attention_case(8, lengths, [], 16, 128, 4, dtype)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("with_long", [False, True], ids=["short", "mixed"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_paged_decode_with_a_graph_bound(
    backend: CupyBackend, dtype: torch.dtype, page_size: int, with_long: bool
) -> None:
    """decode_max_len past every length, as CUDA graphs set it: partitions past a sequence's end are empty."""
    part = backend.tuning.min_partition
    lengths = [page_size + 1, 1, 2 * page_size] + ([2 * part + 37] if with_long else [])
    case = attention_case(4, lengths, [], page_size, 128, 4, dtype, decode_max_len=4 * part + 100)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize(("page_size", "head_dim", "group", "dtype"), ATTENTION_CASES, ids=ATTENTION_IDS)
def test_paged_prefill_over_a_cached_prefix(
    backend: CupyBackend, page_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    prefills = [(0, 2 * page_size + 3), (page_size, 5), (page_size + 5, page_size + 7), (300, 40)]
    case = attention_case(5, [], prefills, page_size, head_dim, group, dtype)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_mixed_batch_of_decodes_and_prefills(
    backend: CupyBackend, dtype: torch.dtype, page_size: int, group: int
) -> None:
    part = backend.tuning.min_partition
    decode_lengths = [page_size, 1, 2 * page_size + 3, part + 3]
    prefills = [(0, page_size + 3), (2 * page_size, 7), (part + 9, 1)]
    case = attention_case(6, decode_lengths, prefills, page_size, 128, group, dtype)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("group", [3, 5, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_attention_of_other_groups_and_a_long_prompt(
    backend: CupyBackend, dtype: torch.dtype, group: int
) -> None:
    """GQA groups that do not divide a 64-row tile (the tensor-core prefill leaves its last rows idle) and up
    to MAX_GROUP; a prompt of several tiles that is no multiple of a page or a tile (151 is prime; a longer
    one only makes the emulator slower: 300 tokens took 159 s of CI at float32 and a group of 16)."""
    decode_lengths = [1, 77, 300]
    prefills = [(0, 151), (45, 70)]
    case = attention_case(9, decode_lengths, prefills, 16, 128, group, dtype)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_attention_of_queries_off_16_bytes(backend: CupyBackend, dtype: torch.dtype) -> None:
    """q one element past 16 bytes: the tensor-core kernels, which copy 16 bytes at a time, step aside."""
    case = attention_case(10, [1, 77, 300], [(0, 70), (45, 9)], 16, 128, 4, dtype, offset=1)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_windows_softcaps_and_sinks(
    backend: CupyBackend, dtype: torch.dtype, page_size: int, kind: str
) -> None:
    """Each layer variation (kernels.LayerAttention) in decodes of one partition and of several, and in
    prefill chunks that start before, across and past the window. The kernels' pool holds NaN in every slot
    before a window, and their block tables the null page for each page wholly before it."""
    part = backend.tuning.min_partition
    window = part + page_size + 3  # a window that starts mid-page and spans more than a partition
    decode_lengths = [1, window - 1, window, window + 1, 3 * part + 7, 5 * page_size + 4]
    prefills = [(0, window + 10), (window + 20, 7), (3, 5), (2 * window, 1)]
    layer = varied_layers(generator(page_size), 64**-0.5, 4 * KV_HEADS, window)[kind]
    if layer.sinks is not None:
        layer = dataclasses.replace(layer, sinks=layer.sinks.to(DEVICE, dtype))
    case = attention_case(11, decode_lengths, prefills, page_size, 64, 4, dtype, window=layer.window)

    actual, expected = run_attention(case, backend, layer)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("split", [False, True], ids=["one-partition", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_attention_wrappers_write_every_output_element(
    backend: CupyBackend, dtype: torch.dtype, split: bool
) -> None:
    """cuda_ops.paged_decode and paged_prefill called directly, into an output filled with NaN."""
    part = backend.tuning.min_partition
    decode_lengths = [17, 1, 2 * part + 37 if split else 200]
    case = attention_case(7, decode_lengths, [(0, 20), (33, 9)], 16, 128, 4, dtype)
    q, meta, n = case.fused.q, case.meta, case.meta.num_decodes
    _, expected = run_attention(case, backend)  # also writes this step's KV into the poisoned pool
    out = torch.full(q.shape, NAN, dtype=dtype, device=DEVICE)

    cuda_ops.paged_decode(
        out[:n],
        q[:n],
        case.poisoned,
        meta.block_tables[:n],
        meta.seq_lens[:n],
        meta.decode_max_len,
        LayerAttention(case.scale),
        backend.tuning,
    )
    cuda_ops.paged_prefill(out[n:], q[n:], case.poisoned, meta, LayerAttention(case.scale), backend.tuning)

    assert_close(out, expected, dtype)
