"""Inputs for the CUDA kernel tests, and their comparison with TorchBackend on the same device.

Every test draws fresh random inputs from a seeded CPU generator. The attention cases keep two copies of a
pool: the reference reads one that is finite everywhere; the kernels read one where every slot they must not
read (the null page, pages nobody owns, the rest of each sequence's last page) holds NaN, and so does every
slot this step writes before reading it. Inputs that are views of wider rows have NaN in the columns around
them, which a kernel that ignores a stride would read. Comparisons are in float32, against a tolerance of
the expected values' scale.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import pytest
import torch

from pagedserve.kernels import cuda_ops
from pagedserve.kernels.backend import AttentionMetadata, LayerAttention
from pagedserve.kernels.cupy_backend import CupyBackend
from pagedserve.kernels.torch_ref import TorchBackend
from tests.devices import kernel_device
from tests.kernels.references import null_before
from tests.kernels.steps import Chunk, dtype_name, generator, make_metadata, slots_of

DEVICE = kernel_device()  # the GPU, or the CPU for the kernels' emulator
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PAGE_SIZES = cuda_ops.PAGE_SIZES  # 8, 16, 32
HEAD_DIMS = cuda_ops.HEAD_DIMS  # 64, 128
GROUPS = (1, 4, 8)  # query heads per KV head
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # of the expected scale
KV_HEADS = 2
SPARE_PAGES = 5  # pages no sequence owns
PAD = 32  # NaN columns on each side of a strided input's rows
EPS = 1e-6
REFERENCE = TorchBackend()
NAN = float("nan")


# Where a view's rows start: on 16 bytes, which the kernels then move 16 bytes at a time, or one element off.
OFFSETS = pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])

ATTENTION_CASES = list(itertools.product(PAGE_SIZES, HEAD_DIMS, GROUPS, DTYPES))
ATTENTION_IDS = [f"B{b}-D{d}-G{g}-{dtype_name(t)}" for b, d, g, t in ATTENTION_CASES]


# Inputs -------------------------------------------------------------------------------------------------


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values, drawn on the CPU (the same on any machine), on the device in dtype."""
    return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)


def on_device(values: Seq[int] | Seq[Seq[int]]) -> torch.Tensor:
    """Contiguous int64 on the device, as the wrappers require of every index tensor."""
    return torch.tensor(values, dtype=torch.int64).to(DEVICE)


def padded_rows(gen: torch.Generator, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, PAD + width + PAD] with random values in the middle columns and NaN around them."""
    buffer = torch.full((rows, width + 2 * PAD), NAN, dtype=dtype, device=DEVICE)
    buffer[:, PAD : PAD + width] = randn(gen, rows, width, dtype=dtype)
    return buffer


@dataclass(frozen=True)
class Fused:
    """A fused QKV projection's output with NaN columns around it, and its q, k, v views."""

    buffer: torch.Tensor  # [T, PAD + (Hq + 2 Hkv) D + PAD]
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]


def fused_qkv(
    gen: torch.Generator, tokens: int, q_heads: int, head_dim: int, dtype: torch.dtype, offset: int = 0
) -> Fused:
    """offset columns of random values between the left padding and q: 1 puts q, k and v off 16 bytes."""
    widths = [q_heads * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim]
    buffer = padded_rows(gen, tokens, offset + sum(widths), dtype)
    q, k, v = buffer[:, PAD + offset : PAD + offset + sum(widths)].split(widths, dim=-1)
    return Fused(
        buffer,
        q.view(tokens, q_heads, head_dim),
        k.view(tokens, KV_HEADS, head_dim),
        v.view(tokens, KV_HEADS, head_dim),
    )


def random_pool(
    gen: torch.Generator, num_pages: int, page_size: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """One layer's KV, [2, P, B, Hkv, D], of random values."""
    return randn(gen, 2, num_pages, page_size, KV_HEADS, head_dim, dtype=dtype)


def random_tables(
    gen: torch.Generator, lengths: Seq[int], page_size: int
) -> tuple[list[tuple[int, ...]], int]:
    """Block tables for sequences of these lengths, distinct pages in random order (never the null page 0),
    and the number of pages of a pool that holds them and SPARE_PAGES more."""
    counts = [-(-n // page_size) for n in lengths]
    num_pages = 1 + sum(counts) + SPARE_PAGES
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    bounds = [0, *itertools.accumulate(counts)]
    return [tuple(order[a:b]) for a, b in itertools.pairwise(bounds)], num_pages


@dataclass(frozen=True)
class AttentionCase:
    clean: torch.Tensor  # the reference's [2, P, B, Hkv, D]: finite everywhere
    poisoned: torch.Tensor  # the kernels': NaN wherever they must not read before they write
    fused: Fused  # this step's q, k, v
    meta: AttentionMetadata
    scale: float
    # The kernels' metadata: meta, but with a window the null page in place of every page wholly before it,
    # as the engine leaves a sequence's table once those pages have gone back to the pool.
    kernel_meta: AttentionMetadata


def attention_case(
    seed: int,
    decode_lengths: Seq[int],
    prefills: Seq[tuple[int, int]],  # (cached, new) tokens of each prefill chunk
    page_size: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    decode_max_len: int | None = None,
    offset: int = 0,
    window: int = 0,
) -> AttentionCase:
    """With a window, the kernels' pool also holds NaN in every slot before each chunk's first query's window,
    and their block tables the (poisoned) null page for each page wholly before it."""
    gen = generator(seed)
    lengths = [*decode_lengths, *(cached + new for cached, new in prefills)]
    tables, num_pages = random_tables(gen, lengths, page_size)
    decodes = [
        Chunk(table, n - 1, 1) for table, n in zip(tables[: len(decode_lengths)], decode_lengths, strict=True)
    ]
    chunks = [Chunk(table, s, n) for table, (s, n) in zip(tables[len(decodes) :], prefills, strict=True)]
    clean = random_pool(gen, num_pages, page_size, head_dim, dtype)
    poisoned = clean.clone()
    owned = {page for table in tables for page in table}
    poisoned[:, [page for page in range(num_pages) if page not in owned]] = NAN  # the null page included
    unseen = [max(0, chunk.start - window + 1) if window else 0 for chunk in [*decodes, *chunks]]
    for chunk, before in zip([*decodes, *chunks], unseen, strict=True):
        # this step's slots, the rest of the last page, and those before the window
        rest = [*range(before), *range(chunk.start, len(chunk.pages) * page_size)]
        poisoned.view(2, -1, KV_HEADS, head_dim)[:, on_device(slots_of(chunk.pages, rest, page_size))] = NAN
    tokens = len(decodes) + sum(chunk.count for chunk in chunks)
    fused = fused_qkv(gen, tokens, group * KV_HEADS, head_dim, dtype, offset)
    meta = make_metadata(decodes, chunks, page_size, DEVICE, decode_max_len)
    nulled = [
        Chunk(null_before(c.pages, first, page_size), c.start, c.count)
        for c, first in zip([*decodes, *chunks], unseen, strict=True)
    ]
    kernel_meta = make_metadata(
        nulled[: len(decodes)], nulled[len(decodes) :], page_size, DEVICE, decode_max_len
    )
    return AttentionCase(clean, poisoned, fused, meta, head_dim**-0.5, kernel_meta)


def run_attention(
    case: AttentionCase, backend: CupyBackend, layer: LayerAttention | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's KV written first, as the model does, then attention as `layer` says (plain, at the case's
    scale, by default): the kernels on the poisoned pool, the reference on the clean one. Returns (actual,
    expected)."""
    q, k, v, meta = case.fused.q, case.fused.k, case.fused.v, case.meta
    layer = layer or LayerAttention(case.scale)
    REFERENCE.write_kv(case.clean, k, v, meta.slot_mapping)
    expected = REFERENCE.paged_attention(q, case.clean, meta, layer)
    backend.write_kv(case.poisoned, k, v, meta.slot_mapping)
    actual = backend.paged_attention(q, case.poisoned, case.kernel_meta, layer)
    return actual, expected


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Within TOLERANCE[dtype] of the expected values' scale (their largest magnitude, at least 1)."""
    assert actual.shape == expected.shape, f"{what} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual, expected = actual.float(), expected.float()
    finite = bool(torch.isfinite(actual).all())
    assert finite, f"{what} has NaN or inf"
    scale = max(expected.abs().max().item(), 1.0)
    error = (actual - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, (
        f"{what} max error {error:.3g} > {TOLERANCE[dtype]} x {scale:.3g}"
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN included."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )
