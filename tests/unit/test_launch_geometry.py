"""The grids' geometry (pagedserve/kernels/tuning.py): the decode grid's split of each context (enough blocks
to fill the device twice over, no split for a batch that fills it alone, no partition shorter than the
minimum) and the tensor-core prefill's tiles; and the CUDA graphs' batch sizes."""

from __future__ import annotations

import itertools

import pytest

from pagedserve.kernels.tuning import (
    DECODE_WAVES,
    PARTITION_QUANTUM,
    TUNINGS,
    decode_mma_stages,
    decode_split,
    prefill_tiles,
)
from services.worker.core.cuda_graphs import graph_sizes
from tests.kernels.steps import Chunk, make_metadata

H200_SMS = 132


@pytest.mark.parametrize("kv_heads", [1, 8])
def test_one_long_sequence_is_spread_over_every_sm(kv_heads: int) -> None:
    """Batch 1 at 4096 tokens: one partition per 512 tokens ran 8 x kv_heads blocks on 132 SMs."""
    split = decode_split(1, kv_heads, 4096, 4 * H200_SMS, 64, 8192)
    assert (split.partitions, split.partition_size) == (64, 64)  # as many as the minimum length allows
    assert kv_heads * split.partitions >= min(64 * kv_heads, H200_SMS)


def test_a_large_batch_is_split_into_two_waves() -> None:
    split = decode_split(64, 8, 4096, 4 * H200_SMS, 64, 8192)
    assert 64 * 8 * split.partitions >= DECODE_WAVES * 4 * H200_SMS
    assert split.partitions == 3 and split.partition_size == 1376  # 4096 / 3, rounded up to whole pages


def test_a_batch_that_fills_the_device_is_not_split() -> None:
    split = decode_split(256, 8, 4096, 4 * H200_SMS, 64, 8192)
    assert (split.partitions, split.partition_size) == (1, 4096)


def test_no_partition_is_longer_than_the_maximum() -> None:
    """A batch that fills the device, at 100k tokens: split all the same, into partitions of 8192 or less."""
    split = decode_split(256, 8, 100_000, 4 * H200_SMS, 64, 8192)
    assert split.partitions == 13 and split.partition_size <= 8192


@pytest.mark.parametrize("max_len", [0, 1, 63, 64, 65, 200])
def test_short_contexts_are_one_partition_until_twice_the_minimum(max_len: int) -> None:
    split = decode_split(1, 1, max_len, 1000, 64, 8192)
    assert split.partitions == max(1, max_len // 64) and split.partitions * split.partition_size >= max_len


def test_every_split_covers_the_context_in_whole_quanta_with_no_empty_partition() -> None:
    for seqs, kv_heads, max_len, resident, minimum in itertools.product(
        (1, 3, 64, 500), (1, 2, 8), (1, 31, 32, 33, 1000, 4096, 131072), (8, 528, 4224), (32, 64, 256)
    ):
        split = decode_split(seqs, kv_heads, max_len, resident, minimum, 8192)
        case = (seqs, kv_heads, max_len, resident, minimum, split)
        assert split.partition_size % PARTITION_QUANTUM == 0 and split.partition_size <= 8192, case
        assert split.partitions * split.partition_size >= max_len, case
        last_has_tokens = (split.partitions - 1) * split.partition_size < max(1, max_len)
        assert last_has_tokens, case
        if split.partitions > 1:
            assert split.partition_size >= minimum, case
            # No more partitions than needed: one fewer would fill the device only when the longest allowed
            # partition forces them.
            fewer_fill = seqs * kv_heads * (split.partitions - 1) >= DECODE_WAVES * resident
            assert not fewer_fill or split.partitions == -(-max_len // 8192), case


def test_prefill_tiles_cover_every_query_token_once_longest_first() -> None:
    """Two decodes, then chunks of 150 new tokens after 40 cached and of 5 after none; tiles of 64 tokens."""
    chunks = [Chunk((1, 2, 3, 4), 40, 150), Chunk((5,), 0, 5)]
    meta = make_metadata([Chunk((6,), 0, 1), Chunk((7,), 3, 1)], chunks, 64)
    tiles = prefill_tiles(meta, 64)
    assert tiles == [(2, 128, 22, 168), (2, 64, 64, 104), (2, 0, 64, 40), (3, 150, 5, 0)]
    covered = sorted(first + i for _, first, tokens, _ in tiles for i in range(tokens))
    assert covered == list(range(155))


@pytest.mark.parametrize(
    ("limit", "stages"),
    [(227 * 1024, 3), (163 * 1024, 3), (99 * 1024, 2), (60 * 1024, 0)],
    ids=["sm_90", "sm_80", "sm_86", "too-little"],
)
def test_the_tensor_core_decode_pipeline_fits_the_shared_memory_a_block_may_have(
    limit: int, stages: int
) -> None:
    """Head dim 128, pages of 16: three stages need 104,448 bytes, two 71,680; neither: no tensor cores."""
    assert decode_mma_stages(128, 16, TUNINGS[90], limit) == stages


@pytest.mark.parametrize("max_num_seqs", [1, 3, 64, 100, 300])
def test_every_decode_batch_the_scheduler_makes_has_a_graph(max_num_seqs: int) -> None:
    sizes = graph_sizes(max_num_seqs)
    assert sizes[-1] == max_num_seqs and sizes == sorted(set(sizes))
    for batch in range(1, max_num_seqs + 1):
        padded = next(size for size in sizes if size >= batch)
        assert padded - batch <= max(batch // 2, 8), f"batch {batch} pads to {padded}"
