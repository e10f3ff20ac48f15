"""The C++ CPU attention (decode and prefill) and mixture of experts against the torch reference, on fresh
random float32 and bfloat16 inputs: every slot the attention must not read (pages nobody owns, the rest of
each sequence's last page, the keys before a window) holds NaN. bfloat16 inputs are compared with the
reference's float32 math on the same values: the ops sum in float32 and round their output once (the
bfloat16 prefill's products take P as two bfloat16 halves), within bfloat16's tolerance."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels.backend import ExpertWeights, LayerAttention, Routing
from pagedserve.kernels.cpu_backend import SKINNY_ROWS, CpuBackend, cpu_ops
from pagedserve.kernels.cpu_features import cpu_features
from pagedserve.kernels.torch_ref import TorchBackend, moe_reference, route
from tests.kernels.references import (
    KV_HEADS,
    assert_close,
    fused_qkv,
    null_before,
    poison_pages,
    poison_slots,
    random_pool,
    random_tables,
    unowned_pages,
    varied_layers,
)
from tests.kernels.steps import Chunk, generator, make_metadata

# Where a compiler is present the build must succeed: a silent fallback would hide a broken kernel here.
pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
OPS = cpu_ops() if shutil.which("c++") else None
# The backend without bfloat16 arithmetic, and, where this CPU was seen to run it, the one that scores
# bfloat16 keys with vdpbf16ps.
BACKENDS = [] if OPS is None else [CpuBackend(OPS)]
if OPS is not None and cpu_features().avx512_bf16.usable:
    BACKENDS.append(CpuBackend(OPS, cpu_features()))
CASES = list(itertools.product((8, 16, 32), (16, 64, 128), (1, 3, 4)))


def run_both(
    seed: int, lengths: list[int], page_size: int, head_dim: int, group: int, prefill: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decodes of these lengths (and a prefill chunk of `prefill` tokens after them) through both backends."""
    gen = generator(seed)
    tables = random_tables(gen, [*lengths, prefill or 1], page_size)
    kv_layer = random_pool(gen, page_size, head_dim, torch.float32)[0]
    poison_pages(kv_layer, unowned_pages(tables))  # not the null page: the reference pads with it
    for table, n in zip(tables, lengths, strict=False):
        poison_slots(kv_layer, table, range(n, len(table) * page_size))  # the stale tail of the last page
    chunks = [Chunk(table, n - 1, 1) for table, n in zip(tables, lengths, strict=False)]
    if prefill:
        chunks.append(Chunk(tables[-1], 0, prefill))
    q, _, _ = fused_qkv(gen, len(lengths) + prefill, group * KV_HEADS, head_dim, torch.float32)
    meta = make_metadata(chunks[: len(lengths)], chunks[len(lengths) :], page_size)
    scale = head_dim**-0.5
    assert OPS is not None
    reference = TorchBackend().paged_attention(q, kv_layer.clone(), meta, LayerAttention(scale))
    return CpuBackend(OPS).paged_attention(q, kv_layer, meta, LayerAttention(scale)), reference


@pytest.mark.parametrize(("page_size", "head_dim", "group"), CASES)
def test_decode_matches_the_reference_and_reads_no_slot_past_a_length(
    page_size: int, head_dim: int, group: int
) -> None:
    lengths = [2 * page_size + 3, 1, 3 * page_size, page_size, 5 * page_size - 1]
    actual, expected = run_both(page_size * 7 + head_dim + group, lengths, page_size, head_dim, group)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_decodes_far_apart_in_length_beside_a_prefill_chunk() -> None:
    actual, expected = run_both(11, [1, 231, 15, 8], page_size=8, head_dim=64, group=3, prefill=20)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def run_attention(
    seed: int,
    decodes: list[int],
    chunks: list[tuple[int, int]],
    page_size: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    layer: LayerAttention | None = None,
    kv_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decodes of these lengths, then prefill chunks of (cached, new) tokens, through the C++ backends on a
    pool (of kv_dtype, else dtype) where every slot they must not read is NaN (their outputs, one a
    backend), and through the reference in float32 on a clean one."""
    gen = generator(seed)
    lengths = [*decodes, *(cached + new for cached, new in chunks)]
    tables = random_tables(gen, lengths, page_size)
    kv_layer = random_pool(gen, page_size, head_dim, kv_dtype or dtype)[0]
    layer = layer or LayerAttention(head_dim**-0.5)
    steps = [Chunk(t, n - 1, 1) for t, n in zip(tables, decodes, strict=False)]
    steps += [Chunk(t, c, n) for t, (c, n) in zip(tables[len(decodes) :], chunks, strict=True)]
    poisoned = kv_layer.clone()
    poison_pages(poisoned, unowned_pages(tables))
    for step in steps:
        poison_slots(poisoned, step.pages, range(step.end, len(step.pages) * page_size))
        if layer.window:  # before the first query's window
            poison_slots(poisoned, step.pages, range(max(0, step.start + 1 - layer.window)))
    q, _, _ = fused_qkv(gen, sum(step.count for step in steps), group * KV_HEADS, head_dim, dtype)
    meta = make_metadata(steps[: len(decodes)], steps[len(decodes) :], page_size)
    actuals = [backend.paged_attention(q, poisoned, meta, layer) for backend in BACKENDS]
    assert actuals and all(actual.dtype == dtype for actual in actuals)
    return actuals, TorchBackend().paged_attention(q.float(), kv_layer.float(), meta, layer)


PREFILL_CASES = list(
    itertools.product((8, 16, 32), (16, 64, 128), (1, 3, 4), (torch.float32, torch.bfloat16))
)


@pytest.mark.parametrize(("page_size", "head_dim", "group"), [(16, 64, 3), (8, 128, 1), (32, 16, 4)])
def test_float32_queries_over_a_bfloat16_pool_match_the_reference(
    page_size: int, head_dim: int, group: int
) -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: decodes and prefill chunks read the narrower pool and
    compute in float32, so they agree with float32 math on the pool's values to float32's tolerance (and the
    bfloat16 prefill's products, which multiply bfloat16 queries, do not take them)."""
    chunks = [(0, 37), (23, 50), (0, 1)]
    actuals, expected = run_attention(
        page_size + head_dim,
        [5, 40, 3 * page_size + 1],
        chunks,
        page_size,
        head_dim,
        group,
        torch.float32,
        kv_dtype=torch.bfloat16,
    )
    for actual in actuals:
        assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize(
    ("page_size", "head_dim", "group", "dtype"),
    PREFILL_CASES,
    ids=[f"B{b}-D{d}-G{g}-{str(t)[6:]}" for b, d, g, t in PREFILL_CASES],
)
def test_prefill_chunks_beside_decodes_match_the_reference(
    page_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """Chunks with and without a cached prefix, shorter and longer than a task's 16 tokens and a key tile,
    one of a single token, beside decodes of very different lengths."""
    chunks = [(0, 37), (23, 50), (70, 9), (0, 1), (5, 1)]
    actuals, expected = run_attention(
        page_size + head_dim + group, [5, 40], chunks, page_size, head_dim, group, dtype
    )
    for actual in actuals:
        assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("page_size", (8, 16))
def test_prefill_windows_softcaps_and_sinks_read_nothing_before_the_window(
    page_size: int, kind: str, dtype: torch.dtype
) -> None:
    """A window of 2 pages and 3 tokens: chunks that start before it ends, and past it with a cached prefix
    longer than it (whose keys before the window are NaN)."""
    window = 2 * page_size + 3
    layer = varied_layers(generator(page_size), 64**-0.5, 3 * KV_HEADS, window)[kind]
    chunks = [(0, window + 20), (4 * page_size, 40), (9 * page_size + 1, 3)]
    actuals, expected = run_attention(31 + page_size, [window + 5], chunks, page_size, 64, 3, dtype, layer)
    for actual in actuals:
        assert_close(actual, expected, dtype)


@pytest.mark.parametrize("windowed", [False, True], ids=["plain", "window"])
@pytest.mark.parametrize("head_dim", [32, 72, 96, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_prefills_of_many_key_steps_match_the_reference(
    dtype: torch.dtype, head_dim: int, windowed: bool
) -> None:
    """The prefill takes keys 128 at a time: chunks over several such steps, a window whose first key lies
    past the first step (so the keys it copies start there), and a task of 16 tokens across a step's edge,
    whose rows before it see none of the next step's keys. Heads of one, three and eight of 32 columns (a
    tile's, or a vector of bfloat16 pairs', where the CPU multiplies them), and of 72, which is no whole
    number of vectors: the float32 products take an output's columns four vectors at a time, then fewer."""
    layer = LayerAttention(head_dim**-0.5, window=100 if windowed else 0)
    chunks = [(150, 150), (0, 260), (290, 5)]
    actuals, expected = run_attention(head_dim, [77], chunks, 32, head_dim, 3, dtype, layer)
    for actual in actuals:
        assert_close(actual, expected, dtype)


def bfloat16_prefill_paths() -> dict[str, tuple[bool, bool]]:
    """paged_prefill's last two arguments (dot_bf16, amx) for each way of multiplying bfloat16 pairs that this
    CPU was seen to run."""
    found = cpu_features()
    paths = {"vdpbf16ps": (True, False)} if found.avx512_bf16.usable else {}
    if found.avx512_bf16.usable and found.amx_bf16.usable:
        paths["tiles"] = (True, True)
    return paths


def test_the_bfloat16_prefill_products_round_as_the_float32_path_does() -> None:
    """Where this CPU runs AVX512-BF16 (and AMX's tiles, where they run), a bfloat16 prefill's two products
    multiply bfloat16 pairs, P as two bfloat16 halves, so that the output before the last rounding is the
    float32 path's to about float32's: the same bfloat16 but where a value lies at a rounding boundary (0.16%
    of them here with vdpbf16ps on a Zen 4), and never further than a step of bfloat16 at its row's scale. P
    rounded once to bfloat16 was within bfloat16's tolerance, yet it moved a real model's greedy token at a
    near-tie; emulated in float64 on these inputs, it changes 17% of the outputs. The backend takes the
    fastest of them."""
    found = cpu_features()
    ways = bfloat16_prefill_paths()
    if not ways:  # no bfloat16 products here: one path only
        assert not CpuBackend(OPS, found)._dot_bf16
        return
    gen = generator(5)
    page_size, head_dim = 32, 64
    first, second = random_tables(gen, [600, 100], page_size)
    kv = random_pool(gen, page_size, head_dim, torch.bfloat16)[0] * 4  # scores of a few units, as a model's
    q = fused_qkv(gen, 400, 3 * KV_HEADS, head_dim, torch.bfloat16)[0].contiguous()
    # 300 new tokens after 300 cached, and a prompt of 100
    meta = make_metadata([], [Chunk(first, 300, 300), Chunk(second, 0, 100)], page_size)
    args = (q, kv, meta.block_tables, meta.seq_lens, meta.query_start, head_dim**-0.5, 0, 0.0, None)
    sums = OPS.paged_prefill(*args, False, False)
    scale = sums.float().abs().amax(-1, keepdim=True).clamp(min=2**-20)  # each query head's output's
    step = 2.0 ** (torch.floor(torch.log2(scale)) - 7)  # bfloat16's there
    outputs = {name: OPS.paged_prefill(*args, *flags) for name, flags in ways.items()}
    for name, products in outputs.items():
        assert ((products.float() - sums.float()).abs() <= step).all(), name
        assert (products != sums).float().mean() < 0.01, name
    backend = CpuBackend(OPS, found).paged_attention(q, kv, meta, LayerAttention(head_dim**-0.5))
    assert torch.equal(backend, outputs["tiles" if "tiles" in outputs else "vdpbf16ps"])


@pytest.mark.parametrize("kind", ["plain", "window", "softcap", "sinks", "all"])
@pytest.mark.parametrize(("page_size", "head_dim", "group"), [(8, 64, 3), (16, 128, 4), (32, 64, 1)])
def test_bfloat16_decodes_match_the_reference(page_size: int, head_dim: int, group: int, kind: str) -> None:
    """Decodes alone in bfloat16, whose keys the CPU scores with vdpbf16ps where it runs it, 16 keys at a
    time: runs of keys that end mid-page and mid-16, one key, and many pages."""
    window = 2 * page_size + 3
    layer = varied_layers(generator(page_size), head_dim**-0.5, group * KV_HEADS, window).get(
        kind, LayerAttention(head_dim**-0.5)
    )
    decodes = [1, 15, 17, page_size + 5, 7 * page_size - 3, window + 40]
    seed = page_size + len(kind)
    actuals, expected = run_attention(seed, decodes, [], page_size, head_dim, group, torch.bfloat16, layer)
    for actual in actuals:
        assert_close(actual, expected, torch.bfloat16)


@pytest.mark.parametrize("kind", ["plain", "window", "softcap", "sinks", "all"])
@pytest.mark.parametrize(
    ("page_size", "head_dim", "group"), [(8, 64, 3), (16, 128, 4), (32, 32, 1), (16, 256, 2)]
)
def test_a_bfloat16_decode_is_the_prefill_of_its_token_bit_for_bit(
    page_size: int, head_dim: int, group: int, kind: str
) -> None:
    """Where this CPU multiplies bfloat16 pairs with vdpbf16ps (and AMX's tiles do not run the prefill's
    products), a bfloat16 token's attention is the same bits whether a decode computes it or a prefill, at
    any place in a chunk and after any cached prefix: so a sequence's output does not depend on its batch,
    its chunks, or a failover's recompute of some of its tokens. Every position of a sequence of three steps
    of keys, as decodes in one step, against the sequence prefilled whole and in two chunks; every slot past
    its length, and every page it does not own, holds NaN."""
    found = cpu_features()
    if not found.avx512_bf16.usable or found.amx_bf16.usable:  # no bfloat16 decode path, or tiles' products
        assert not CpuBackend(OPS, found)._dot_bf16 or CpuBackend(OPS, found)._amx_attention
        return
    backend = CpuBackend(OPS, found)
    gen = generator(page_size + head_dim + len(kind))
    length, cached = 300, 137
    (table,) = random_tables(gen, [length], page_size)
    kv = random_pool(gen, page_size, head_dim, torch.bfloat16)[0] * 4  # scores of a few units, as a model's
    poison_pages(kv, unowned_pages([table]))
    poison_slots(kv, table, range(length, len(table) * page_size))
    q = fused_qkv(gen, length, group * KV_HEADS, head_dim, torch.bfloat16)[0].contiguous()
    layer = varied_layers(gen, head_dim**-0.5, group * KV_HEADS, 2 * page_size + 3).get(
        kind, LayerAttention(head_dim**-0.5)
    )

    def attend(decodes: list[Chunk], prefills: list[Chunk], rows: torch.Tensor) -> torch.Tensor:
        return backend.paged_attention(rows, kv, make_metadata(decodes, prefills, page_size), layer)

    whole = attend([], [Chunk(table, 0, length)], q)
    assert not whole.isnan().any()
    decodes = attend([Chunk(table, p, 1) for p in range(length)], [], q)
    assert torch.equal(decodes, whole)
    chunked = attend([], [Chunk(table, cached, length - cached)], q[cached:])
    assert torch.equal(chunked, whole[cached:])
    # A step of both: decodes of the first positions beside the rest as a chunk.
    mixed = attend([Chunk(table, p, 1) for p in range(cached)], [Chunk(table, cached, length - cached)], q)
    assert torch.equal(mixed, whole)


@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("page_size", (8, 16))
def test_windows_softcaps_and_sinks_match_the_reference_and_read_nothing_before_the_window(
    page_size: int, kind: str
) -> None:
    gen = generator(13 + page_size)
    head_dim, group, window = 64, 3, 2 * page_size + 3
    lengths = [1, window - 1, window, 5 * page_size + 4, 9 * page_size]
    tables = random_tables(gen, lengths, page_size)
    kv_layer = random_pool(gen, page_size, head_dim, torch.float32)[0]
    layer = varied_layers(gen, head_dim**-0.5, group * KV_HEADS, window)[kind]
    q, _, _ = fused_qkv(gen, len(lengths), group * KV_HEADS, head_dim, torch.float32)
    reference_tables = tables
    if layer.window:  # the reference reads the null page there, as the engine leaves it once freed
        reference_tables = [
            null_before(t, n - window, page_size) for t, n in zip(tables, lengths, strict=True)
        ]
    poisoned = kv_layer.clone()
    poison_pages(poisoned, unowned_pages(reference_tables))
    for table, n in zip(tables, lengths, strict=True):
        poison_slots(poisoned, table, range(n, len(table) * page_size))
        if layer.window:
            poison_slots(poisoned, table, range(max(0, n - window)))
    decodes = [Chunk(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)]
    expected_decodes = [Chunk(t, n - 1, 1) for t, n in zip(reference_tables, lengths, strict=True)]
    assert OPS is not None

    actual = CpuBackend(OPS).paged_attention(q, poisoned, make_metadata(decodes, [], page_size), layer)
    expected = TorchBackend().paged_attention(
        q, kv_layer, make_metadata(expected_decodes, [], page_size), layer
    )

    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


ROUTINGS = {
    "mixtral": Routing(2, renormalize=True),
    "qwen3-moe": Routing(3),
    "gpt-oss": Routing(2, softmax_of_top=True, swiglu_limit=1.0, swiglu_alpha=1.702),
}


@pytest.mark.parametrize("tokens", [1, 7, 100])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_experts_match_the_reference(routing: str, tokens: int) -> None:
    """A decode's few rows (each expert through skinny_linear) and a prefill's (some experts past SKINNY_ROWS,
    through MKL, with gpt-oss's biases too)."""
    gen = generator(17 + tokens)
    experts, hidden, inner = 8, 64, 32

    def randn(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    biased = routing == "gpt-oss"
    weights = ExpertWeights(
        router=randn(experts, hidden, scale=1.0),
        gate_up=randn(experts, 2 * inner, hidden),
        down=randn(experts, hidden, inner),
        router_bias=randn(experts) if biased else None,
        gate_up_bias=randn(experts, 2 * inner) if biased else None,
        down_bias=randn(experts, hidden) if biased else None,
    )
    x = randn(tokens, hidden, scale=1.0)
    rows = torch.bincount(route(x, weights, ROUTINGS[routing])[1].flatten(), minlength=experts)
    assert (rows.max() > SKINNY_ROWS) == (tokens > SKINNY_ROWS), rows  # the paths the docstring names
    assert OPS is not None
    actual = CpuBackend(OPS).moe(x, weights, ROUTINGS[routing])
    torch.testing.assert_close(actual, moe_reference(x, weights, ROUTINGS[routing]), rtol=1e-5, atol=1e-5)


def test_a_table_naming_a_page_outside_the_pool_is_refused() -> None:
    kv_layer = torch.zeros(2, 4, 8, 1, 16)
    q = torch.zeros(1, 1, 16)
    assert OPS is not None
    with pytest.raises(RuntimeError, match="outside the pool"):
        OPS.paged_decode(q, kv_layer, torch.tensor([[9]]), torch.tensor([3]), 1.0, 0, 0.0, None, False)
    if cpu_features().avx512_bf16.usable:  # the keys scored with vdpbf16ps: bfloat16, a head of 32
        kv, query = (
            torch.zeros(2, 4, 8, 1, 32, dtype=torch.bfloat16),
            torch.zeros(1, 1, 32, dtype=torch.bfloat16),
        )
        with pytest.raises(RuntimeError, match="outside the pool"):
            OPS.paged_decode(query, kv, torch.tensor([[9]]), torch.tensor([3]), 1.0, 0, 0.0, None, True)
    starts, lens = torch.tensor([0, 1]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="outside the pool"):
        OPS.paged_prefill(q, kv_layer, torch.tensor([[-1]]), lens, starts, 1.0, 0, 0.0, None, False, False)
    for flags in bfloat16_prefill_paths().values():  # the keys copied for them: bfloat16, a head of 32
        kv, query = (
            torch.zeros(2, 4, 8, 1, 32, dtype=torch.bfloat16),
            torch.zeros(1, 1, 32, dtype=torch.bfloat16),
        )
        with pytest.raises(RuntimeError, match="outside the pool"):
            OPS.paged_prefill(query, kv, torch.tensor([[-1]]), lens, starts, 1.0, 0, 0.0, None, *flags)


@pytest.mark.parametrize(
    ("lens", "starts", "message"),
    [
        ([3], [0, 2], "query_start must run from 0 to 1"),
        ([3], [1, 1], "query_start must run from 0 to 1"),
        ([0], [0, 1], "new tokens do not fit its length 0"),
        ([9], [0, 1], "new tokens do not fit its length 9"),  # past its table of one page of 8
        ([3, 3], [0, 2, 1], "sequence 1's -1 new tokens"),
    ],
)
def test_prefill_lengths_that_do_not_fit_are_refused(
    lens: list[int], starts: list[int], message: str
) -> None:
    kv_layer, q = torch.zeros(2, 4, 8, 1, 16), torch.zeros(1, 1, 16)
    tables = torch.ones(len(lens), 1, dtype=torch.int64)
    assert OPS is not None
    with pytest.raises(RuntimeError, match=message):
        OPS.paged_prefill(
            q, kv_layer, tables, torch.tensor(lens), torch.tensor(starts), 1.0, 0, 0.0, None, False, False
        )


def test_one_sequence_alone_on_two_threads_matches_the_reference() -> None:
    """Fewer sequences than threads: the kernel gives each KV head a task of its own (paged_decode.cpp), so
    that the threads share one sequence. The result is all that is seen here, not how it was split."""
    assert torch.get_num_threads() >= 2, "one thread would not split (tests/kernels/conftest.py gives two)"
    actual, expected = run_both(12, [77], page_size=16, head_dim=64, group=3)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_with_no_compiler_the_worker_runs_the_torch_reference(tmp_path: Path) -> None:
    """A fresh cache and a compiler that is not there: the build fails, and the backend is torch's."""
    script = (
        "import torch; from pagedserve.kernels.cpu_backend import cpu_ops; "
        "from services.worker.config import WorkerConfig; from services.worker.server import kernel_backend; "
        "assert cpu_ops() is None; "
        "print(kernel_backend(WorkerConfig(device='cpu'), torch.device('cpu')).name)"
    )
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-compiler")}
    env.pop("PAGEDSERVE_CPU_KERNELS", None)  # it would name a folder with a finished build
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "torch"
    assert "could not be built" in done.stderr
