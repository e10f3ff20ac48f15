"""Launch parameters per GPU architecture, picked at run time.

The values are starting points for Ampere (sm_80) and Hopper (sm_90), chosen from the kernels' shapes:
decode blocks of 4 warps that each stream rows of K and V, partitions of 512 tokens so that batch 64 at 4k
context fills an H100 or H200 with 8 partitions per sequence, and 256-thread blocks for the row-wise
kernels. scripts/gpu_check.sh times the alternatives on a real device; write what it finds here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    decode_warps: int
    partition_size: int  # tokens of a sequence one decode block reduces; a multiple of every page size
    prefill_warps: int
    row_threads: int  # threads per block of the row-wise kernels (KV write, norms, rotary, activation)


TUNINGS = {
    80: Tuning(decode_warps=4, partition_size=512, prefill_warps=4, row_threads=256),
    90: Tuning(decode_warps=4, partition_size=512, prefill_warps=4, row_threads=256),
}


def tuning_for(compute_capability: int) -> Tuning:
    """The tuning of the newest architecture at or below this one (sm_80's for anything older)."""
    known = [cc for cc in TUNINGS if cc <= compute_capability]
    return TUNINGS[max(known)] if known else TUNINGS[min(TUNINGS)]
