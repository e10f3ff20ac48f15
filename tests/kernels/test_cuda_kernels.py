"""The CUDA kernels (CupyBackend, and cuda_ops' typed wrappers) against TorchBackend on the same device.

Every test draws fresh random inputs from a seeded CPU generator. The attention tests keep two copies of a
pool: the reference reads one that is finite everywhere; the kernels read one where every slot they must not
read (the null page, pages nobody owns, the rest of each sequence's last page) holds NaN, and so does every
slot this step writes before reading it. Inputs that are views of wider rows have NaN in the columns around
them, which a kernel that ignores a stride would read. Comparisons are in float32, against a tolerance of
the expected values' scale.

Needs a CUDA device and CuPy; skipped without them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels import AttentionMetadata, TorchBackend, cuda_ops
from kernels.cupy_backend import CupyBackend
from kernels.tuning import Tuning
from services.common.sampling import SamplingOptions
from services.worker.core.batch import build_batch
from services.worker.core.cuda_graphs import DecodeGraphs
from services.worker.core.scheduler import ScheduledSeq
from services.worker.core.sequence import Sequence
from services.worker.models import CausalLM
from services.worker.models.llama import rotary_table
from tests.kernels.steps import Chunk, llama_spec, make_metadata, slots_of
from tests.models import make_model

pytestmark = pytest.mark.gpu  # skipped without a CUDA device and CuPy: tests/conftest.py

DEVICE = torch.device("cuda")
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


ATTENTION_CASES = list(itertools.product(PAGE_SIZES, HEAD_DIMS, GROUPS, DTYPES))
ATTENTION_IDS = [f"B{b}-D{d}-G{g}-{dtype_name(t)}" for b, d, g, t in ATTENTION_CASES]


@pytest.fixture(scope="module")
def backend() -> CupyBackend:
    return CupyBackend(DEVICE)


# Inputs -------------------------------------------------------------------------------------------------


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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


def fused_qkv(gen: torch.Generator, tokens: int, q_heads: int, head_dim: int, dtype: torch.dtype) -> Fused:
    widths = [q_heads * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim]
    buffer = padded_rows(gen, tokens, sum(widths), dtype)
    q, k, v = buffer[:, PAD : PAD + sum(widths)].split(widths, dim=-1)
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


def attention_case(
    seed: int,
    decode_lengths: Seq[int],
    prefills: Seq[tuple[int, int]],  # (cached, new) tokens of each prefill chunk
    page_size: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    decode_max_len: int | None = None,
) -> AttentionCase:
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
    for chunk in [*decodes, *chunks]:  # this step's slots, and the rest of the last page
        rest = slots_of(chunk.pages, range(chunk.start, len(chunk.pages) * page_size), page_size)
        poisoned.view(2, -1, KV_HEADS, head_dim)[:, on_device(rest)] = NAN
    tokens = len(decodes) + sum(chunk.count for chunk in chunks)
    fused = fused_qkv(gen, tokens, group * KV_HEADS, head_dim, dtype)
    meta = make_metadata(decodes, chunks, page_size, DEVICE, decode_max_len)
    return AttentionCase(clean, poisoned, fused, meta, head_dim**-0.5)


def run_attention(case: AttentionCase, backend: CupyBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's KV written first, as the model does, then attention: the kernels on the poisoned pool,
    the reference on the clean one. Returns (actual, expected)."""
    q, k, v, meta = case.fused.q, case.fused.k, case.fused.v, case.meta
    REFERENCE.write_kv(case.clean, k, v, meta.slot_mapping)
    expected = REFERENCE.paged_attention(q, case.clean, meta, case.scale)
    backend.write_kv(case.poisoned, k, v, meta.slot_mapping)
    actual = backend.paged_attention(q, case.poisoned, meta, case.scale)
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


# KV write -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_kv_write(backend: CupyBackend, dtype: torch.dtype, page_size: int, head_dim: int) -> None:
    gen = generator(1)
    num_pages, tokens = 24, 2 * page_size + 5
    pool = randn(gen, 2, 2, num_pages, page_size, KV_HEADS, head_dim, dtype=dtype)  # two layers
    slots = torch.randperm((num_pages - 1) * page_size, generator=gen)[:tokens] + page_size  # not page 0
    slots[::4] = -1  # padding rows, as in a CUDA graph's batch: skipped
    slots = slots.to(DEVICE)
    written = slots >= 0
    fused = fused_qkv(gen, tokens, 3 * KV_HEADS, head_dim, dtype)
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
    assert case.meta.decode_max_len <= backend.tuning.partition_size

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize(("page_size", "head_dim", "group", "dtype"), ATTENTION_CASES, ids=ATTENTION_IDS)
def test_paged_decode_split_k(
    backend: CupyBackend, page_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """Long and short sequences in one batch: several partitions each, merged by the second kernel."""
    part = backend.tuning.partition_size
    lengths = [2 * part + 37, 1, part, page_size + 3, part + 1, 3 * part]
    case = attention_case(3, lengths, [], page_size, head_dim, group, dtype)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("with_long", [False, True], ids=["short", "mixed"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_paged_decode_with_a_graph_bound(
    backend: CupyBackend, dtype: torch.dtype, page_size: int, with_long: bool
) -> None:
    """decode_max_len past every length, as CUDA graphs set it: partitions past a sequence's end are empty."""
    part = backend.tuning.partition_size
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
    part = backend.tuning.partition_size
    decode_lengths = [page_size, 1, 2 * page_size + 3, part + 3]
    prefills = [(0, page_size + 3), (2 * page_size, 7), (part + 9, 1)]
    case = attention_case(6, decode_lengths, prefills, page_size, 128, group, dtype)

    actual, expected = run_attention(case, backend)

    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("split", [False, True], ids=["one-partition", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_attention_wrappers_write_every_output_element(
    backend: CupyBackend, dtype: torch.dtype, split: bool
) -> None:
    """cuda_ops.paged_decode and paged_prefill called directly, into an output filled with NaN."""
    part = backend.tuning.partition_size
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
        case.scale,
        backend.tuning,
    )
    cuda_ops.paged_prefill(
        out[n:],
        q[n:],
        case.poisoned,
        meta.block_tables,
        meta.prefill_seq,
        meta.prefill_pos,
        case.scale,
        backend.tuning,
    )

    assert_close(out, expected, dtype)


# Row-wise kernels ---------------------------------------------------------------------------------------

NORM_SHAPES = [(7, 64), (5, 1000), (3, 4096), (6, 4, 64), (5, 4, 128)]  # [T, H], and [T, heads, D]


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_rms_norm(
    backend: CupyBackend, dtype: torch.dtype, shape: tuple[int, ...], with_residual: bool
) -> None:
    gen = generator(8)
    rows, width = shape[0], math.prod(shape[1:])
    x = padded_rows(gen, rows, width, dtype)[:, PAD : PAD + width].view(shape)  # rows PAD apart, as q's are
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=gen)).to(device=DEVICE, dtype=dtype)
    residual = randn(gen, *shape, dtype=dtype) if with_residual else None
    x_before = x.clone()
    expected, expected_residual = REFERENCE.rms_norm(
        x, weight, EPS, None if residual is None else residual.clone()
    )

    normed, new_residual = backend.rms_norm(x, weight, EPS, residual)

    assert normed.is_contiguous() and normed.dtype == dtype
    assert_close(normed, expected, dtype)
    # the sum is rounded to the dtype once, by both: it must match to the bit
    assert torch.equal(new_residual, expected_residual), "the new residual is not x + residual"
    assert torch.equal(x, x_before), "x changed"


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_rotary_in_place(backend: CupyBackend, dtype: torch.dtype, head_dim: int, group: int) -> None:
    gen = generator(9)
    spec = llama_spec(head_dim, max_positions=4096)
    cos_sin = rotary_table(spec, DEVICE, dtype)
    tokens = 37
    positions = torch.randint(0, spec.max_model_len, (tokens,), generator=gen).to(DEVICE)
    fused = fused_qkv(gen, tokens, group * KV_HEADS, head_dim, dtype)
    fused.v.fill_(NAN)  # V, like the padding columns, is neither read nor written
    expected_q, expected_k = REFERENCE.rotary(fused.q.clone(), fused.k.clone(), positions, cos_sin)
    buffer_before = fused.buffer.clone()

    q_out, k_out = backend.rotary(fused.q, fused.k, positions, cos_sin)

    assert q_out.data_ptr() == fused.q.data_ptr() and k_out.data_ptr() == fused.k.data_ptr(), "not in place"
    assert_close(fused.q, expected_q, dtype, "q")
    assert_close(fused.k, expected_k, dtype, "k")
    qk_end = PAD + (group + 1) * KV_HEADS * head_dim
    assert same_bits(fused.buffer[:, :PAD], buffer_before[:, :PAD])
    assert same_bits(fused.buffer[:, qk_end:], buffer_before[:, qk_end:]), "V or the padding changed"


@pytest.mark.parametrize("inner", [64, 1000, 5632])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_silu_and_mul(backend: CupyBackend, dtype: torch.dtype, inner: int) -> None:
    gen = generator(10)
    x = padded_rows(gen, 9, 2 * inner, dtype)[:, PAD : PAD + 2 * inner]  # rows further apart than 2 I

    out = backend.silu_and_mul(x)

    assert out.shape == (9, inner) and out.is_contiguous() and out.dtype == dtype
    assert_close(out, REFERENCE.silu_and_mul(x), dtype)


# The wrappers' checks -----------------------------------------------------------------------------------


def zeros(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


def index(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


POOL = (2, 4, 16, 2, 64)  # a valid kv_layer: [2, P, B, Hkv, D]

# Each call is valid but for the one thing its name says, and must raise ValueError before any launch.
BAD_CALLS: dict[str, Callable[[Tuning], object]] = {
    "kv_write-k-in-another-dtype": lambda t: cuda_ops.kv_write(
        zeros(*POOL), zeros(3, 2, 64, dtype=torch.float16), zeros(3, 2, 64), index(3), t
    ),
    "kv_write-float64": lambda t: cuda_ops.kv_write(
        zeros(*POOL, dtype=torch.float64),
        zeros(3, 2, 64, dtype=torch.float64),
        zeros(3, 2, 64, dtype=torch.float64),
        index(3),
        t,
    ),
    "kv_write-int32-slots": lambda t: cuda_ops.kv_write(
        zeros(*POOL), zeros(3, 2, 64), zeros(3, 2, 64), index(3, dtype=torch.int32), t
    ),
    "kv_write-k-dims-strided": lambda t: cuda_ops.kv_write(
        zeros(*POOL), zeros(3, 64, 2).transpose(1, 2), zeros(3, 2, 64), index(3), t
    ),
    "kv_write-pool-not-contiguous": lambda t: cuda_ops.kv_write(
        zeros(2, 8, 16, 2, 64)[:, ::2], zeros(3, 2, 64), zeros(3, 2, 64), index(3), t
    ),
    "decode-page-size-12": lambda t: cuda_ops.paged_decode(
        zeros(2, 4, 64), zeros(2, 4, 64), zeros(2, 4, 12, 2, 64), index(2, 3), index(2), 16, 0.125, t
    ),
    "decode-head-dim-96": lambda t: cuda_ops.paged_decode(
        zeros(2, 4, 96), zeros(2, 4, 96), zeros(2, 4, 16, 2, 96), index(2, 3), index(2), 16, 0.1, t
    ),
    "decode-17-query-heads-a-kv-head": lambda t: cuda_ops.paged_decode(
        zeros(2, 17, 64), zeros(2, 17, 64), zeros(2, 4, 16, 1, 64), index(2, 3), index(2), 16, 0.125, t
    ),
    "decode-block-tables-not-contiguous": lambda t: cuda_ops.paged_decode(
        zeros(2, 4, 64), zeros(2, 4, 64), zeros(*POOL), index(2, 6)[:, ::2], index(2), 16, 0.125, t
    ),
    "decode-out-not-contiguous": lambda t: cuda_ops.paged_decode(
        zeros(4, 4, 64)[::2], zeros(2, 4, 64), zeros(*POOL), index(2, 3), index(2), 16, 0.125, t
    ),
    "prefill-int32-positions": lambda t: cuda_ops.paged_prefill(
        zeros(3, 4, 64),
        zeros(3, 4, 64),
        zeros(*POOL),
        index(1, 3),
        index(3),
        index(3, dtype=torch.int32),
        0.1,
        t,
    ),
    "rms_norm-x-strided": lambda t: cuda_ops.rms_norm(zeros(4, 256)[:, ::2], zeros(128), EPS, None, t),
    "rms_norm-weight-in-float32": lambda t: cuda_ops.rms_norm(
        zeros(4, 128), zeros(128, dtype=torch.float32), EPS, None, t
    ),
    "rms_norm-residual-not-contiguous": lambda t: cuda_ops.rms_norm(
        zeros(4, 128), zeros(128), EPS, zeros(8, 128)[::2], t
    ),
    "rotary-cos-sin-in-float32": lambda t: cuda_ops.rotary(
        zeros(3, 4, 64), zeros(3, 2, 64), index(3), zeros(16, 2, 64, dtype=torch.float32), t
    ),
    "rotary-positions-not-contiguous": lambda t: cuda_ops.rotary(
        zeros(3, 4, 64), zeros(3, 2, 64), index(6)[::2], zeros(16, 2, 64), t
    ),
    "silu_and_mul-x-strided": lambda t: cuda_ops.silu_and_mul(zeros(4, 256)[:, ::2], t),
    "silu_and_mul-odd-width": lambda t: cuda_ops.silu_and_mul(zeros(4, 7), t),
}


@pytest.mark.parametrize("call", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_wrappers_reject_bad_arguments(backend: CupyBackend, call: Callable[[Tuning], object]) -> None:
    with pytest.raises(ValueError):
        call(backend.tuning)


# CUDA graphs --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Head dim 64 over 2 KV heads, which the kernels take; a context of 2048 tokens, so that the graphs'
    # decode bound spans four partitions.
    return make_model(
        "llama",
        tmp_path_factory.mktemp("graph-model"),
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
    )


def decode_item(gen: torch.Generator, key: int, length: int, pages: Seq[int], vocab: int) -> ScheduledSeq:
    """A running sequence of `length` tokens, all but the last one cached: its step is a decode."""
    tokens = torch.randint(3, vocab, (length,), generator=gen).tolist()
    seq = Sequence(key, tokens, length, SamplingOptions(), 0, key, pages=list(pages), num_computed=length - 1)
    return ScheduledSeq(seq, length - 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_decode_graphs_replay_the_eager_forward(
    backend: CupyBackend, graph_model_dir: Path, dtype: torch.dtype
) -> None:
    page_size = 16
    model = CausalLM.from_pretrained(graph_model_dir, dtype=dtype, device=DEVICE, backend=backend)
    spec = model.spec
    part = backend.tuning.partition_size
    # 3 sequences run on the graph of 4 (one padding row); then 4 other sequences on the same graph.
    batches = [[part + 1, 1, 2 * part + 37], [17, spec.max_model_len, part, 3]]
    gen = generator(11)
    tables, num_pages = random_tables(gen, [n for lengths in batches for n in lengths], page_size)
    shape = (spec.num_layers, 2, num_pages, page_size, spec.num_kv_heads, spec.head_dim)
    guard = 4096  # elements before the pool: a write to a negative slot of layer 0 lands here
    storage = randn(gen, guard + math.prod(shape), dtype=dtype)
    pool = storage[guard:].view(shape)
    storage_before = storage.clone()
    graphs = DecodeGraphs(model, pool, max_batch=4, page_size=page_size)
    graphs.capture()
    assert torch.equal(storage, storage_before), "capturing (padding rows only) wrote into the pool"

    pages = iter(tables)
    for lengths in batches:
        items = [decode_item(gen, key, n, next(pages), spec.vocab_size) for key, n in enumerate(lengths)]
        batch = build_batch(items, page_size, DEVICE)
        eager = model.forward(batch.input_ids, batch.positions, batch.meta, pool, batch.logits_indices)
        pool_before = pool.clone()

        replayed = graphs.run(batch)

        assert replayed is not None, "a decode batch within the largest graph replays"
        assert_close(replayed, eager, dtype, f"logits of the batch of lengths {lengths}")
        flat = pool.view(*shape[:2], -1, *shape[4:])  # [L, 2, P * B, Hkv, D]
        untouched = torch.ones(flat.shape[2], dtype=torch.bool, device=DEVICE)
        untouched[batch.meta.slot_mapping] = False
        assert torch.equal(flat[:, :, untouched], pool_before.view_as(flat)[:, :, untouched]), (
            "the replay wrote outside this step's slots"
        )
    assert torch.equal(storage[:guard], storage_before[:guard]), (
        "a padding row (slot -1) wrote before the pool"
    )
