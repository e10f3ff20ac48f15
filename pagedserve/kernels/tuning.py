"""Launch parameters per GPU architecture, picked at run time, and the grids' geometry: the decode grid's
split of each context, the tensor-core prefill's tiles.

The values are starting points for Ampere (sm_80) and Hopper (sm_90), chosen from the kernels' shapes:
decode blocks of 4 warps that each stream rows of K and V, and 256-thread blocks for the row-wise kernels.
scripts/gpu_check.sh times the alternatives on a real device; write what it finds here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.backend import AttentionMetadata

# Partition lengths are multiples of this, which every page size divides, so a partition is whole pages.
PARTITION_QUANTUM = 32
# The decode grid aims at this many waves of the blocks the device holds at once: with one wave, the SMs
# that finish early sit idle while the last blocks run.
DECODE_WAVES = 2


@dataclass(frozen=True)
class Tuning:
    decode_warps: int
    # The fewest tokens of a sequence one decode block reduces, and the most (the tensor-core decode holds
    # its partition's page ids in shared memory); multiples of PARTITION_QUANTUM.
    min_partition: int
    prefill_warps: int
    row_threads: int  # threads per block of the row-wise kernels (KV write, norms, rotary, activation)
    decode_stages: int = 3  # 16-key tiles each warp of the tensor-core decode has in flight, its own included
    max_partition: int = 8192


TUNINGS = {
    80: Tuning(decode_warps=4, min_partition=64, prefill_warps=4, row_threads=256),
    # sm_86 and sm_89 let a block have 99 KiB of shared memory, not 163 or 227: two stages of 16 keys.
    86: Tuning(decode_warps=4, min_partition=64, prefill_warps=4, row_threads=256, decode_stages=2),
    90: Tuning(decode_warps=4, min_partition=64, prefill_warps=4, row_threads=256),
}


def tuning_for(compute_capability: int) -> Tuning:
    """The tuning of the newest architecture at or below this one (sm_80's for anything older)."""
    known = [cc for cc in TUNINGS if cc <= compute_capability]
    return TUNINGS[max(known)] if known else TUNINGS[min(TUNINGS)]


@dataclass(frozen=True)
class DecodeSplit:
    partitions: int  # per sequence and KV head: the grid is (sequences, KV heads, partitions)
    partition_size: int  # tokens each partition covers, a multiple of PARTITION_QUANTUM


def decode_split(
    seqs: int, kv_heads: int, max_len: int, resident_blocks: int, min_partition: int, max_partition: int
) -> DecodeSplit:
    """Cuts each sequence's context (up to max_len tokens) into partitions that separate blocks reduce, so
    that the grid fills the device: sequences x KV heads x partitions >= DECODE_WAVES x resident_blocks (the
    decode blocks all SMs hold at once). A batch that fills it alone is not split, and no partition is
    shorter than min_partition tokens, below which merging the partitions costs more than it gains, nor
    longer than max_partition."""
    wanted = -(-DECODE_WAVES * resident_blocks // max(1, seqs * kv_heads))
    most = max(1, max_len // min_partition)
    partitions = max(1, min(wanted, most), -(-max_len // max_partition))
    size = -(-max(1, max_len) // partitions)
    size = -(-size // PARTITION_QUANTUM) * PARTITION_QUANTUM
    return DecodeSplit(-(-max(1, max_len) // size), size)


def decode_mma_shared_bytes(head_dim: int, page_size: int, tuning: Tuning, stages: int) -> int:
    """paged_decode_mma.cu's SHARED_BYTES: each warp's pipeline of 16-key K and V tiles, the query rows, and
    the partition's page ids (4 bytes each)."""
    pipeline = tuning.decode_warps * stages * 2 * 16 * head_dim * 2
    return pipeline + 16 * head_dim * 2 + tuning.max_partition // page_size * 4


def decode_mma_stages(head_dim: int, page_size: int, tuning: Tuning, limit: int) -> int:
    """The deepest pipeline, up to the tuning's, whose shared memory a block of this device may have; 0 when
    not even two stages fit (the warp-per-row kernel then takes the decode)."""
    fits = [
        stages
        for stages in range(2, tuning.decode_stages + 1)
        if decode_mma_shared_bytes(head_dim, page_size, tuning, stages) <= limit
    ]
    return max(fits, default=0)


def prefill_tiles(meta: AttentionMetadata, tile_tokens: int) -> list[tuple[int, int, int, int]]:
    """The tensor-core prefill's tiles: (block_tables row, first query token among the prefill rows, tokens,
    first position), up to tile_tokens query tokens each, those that see the most keys first, so that the
    grid's last wave holds the short ones."""
    base = meta.query_start_host[meta.num_decodes]
    tiles = []
    for seq in range(meta.num_decodes, meta.num_seqs):
        start, end = meta.query_start_host[seq], meta.query_start_host[seq + 1]
        cached = meta.seq_lens_host[seq] - (end - start)
        for first in range(0, end - start, tile_tokens):
            tiles.append((seq, start - base + first, min(tile_tokens, end - start - first), cached + first))
    return sorted(tiles, key=lambda tile: -(tile[2] + tile[3]))


# The last step's prefill tiles: every layer of a step passes the same metadata, so they are built and
# uploaded once a step. The entry holds the metadata itself, so no other can take its identity meanwhile.
_last_tiles: list[tuple[AttentionMetadata, int, torch.Tensor]] = []


def step_prefill_tiles(meta: AttentionMetadata, tile_tokens: int, device: torch.device) -> torch.Tensor:
    """prefill_tiles(meta, tile_tokens) as an int64 tensor on device, built once for a step's metadata."""
    if _last_tiles and _last_tiles[0][0] is meta and _last_tiles[0][1] == tile_tokens:
        return _last_tiles[0][2]
    tiles = torch.tensor(prefill_tiles(meta, tile_tokens), dtype=torch.int64).to(device, non_blocking=True)
    _last_tiles[:] = [(meta, tile_tokens, tiles)]
    return tiles
