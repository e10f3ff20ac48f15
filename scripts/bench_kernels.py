"""Benchmark the CUDA kernels on a GPU: each against the bytes it must move, beside a device-to-device copy
measured in the same run; paged decode against torch-native paged attention (gather, then matmul and
softmax); and end-to-end tokens/s through `pagedserve up` on a small random model over CUDA IPC.

    python scripts/bench_kernels.py [--json FILE] [--skip-e2e]

Kernels are timed inside CUDA graphs (20 launches a replay, median of the replays) so that Python launch
overhead stays out of the numbers. Shapes are Llama-3-8B's (32 query heads, 8 KV heads, head dim 128,
hidden 4096, MLP 14336), bf16, pages of 16 tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels import cuda_ops  # noqa: E402
from pagedserve.kernels.backend import AttentionMetadata, LayerAttention  # noqa: E402
from pagedserve.kernels.cupy_backend import CupyBackend  # noqa: E402
from pagedserve.kernels.tuning import Tuning  # noqa: E402

DTYPE = torch.bfloat16
Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, PAGE = 32, 8, 128, 4096, 14336, 16
TOKENS = 32768  # rows for the row-wise kernels: each buffer (256 MiB at HIDDEN) is several times the L2
BATCH, CONTEXT = 64, 4096  # paged decode


def graph_time(fn: Callable[[], object], launches: int = 20, replays: int = 15) -> float:
    """Seconds per call of fn: launches calls captured in one CUDA graph, median over replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / launches)
    return statistics.median(times)


def event_time(fn: Callable[[], object], repeats: int = 10) -> float:
    """Seconds per call, timed with events around each call (for work that cannot be captured)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = event_time(lambda: dst.copy_(src))
    return 2 * src.numel() / seconds


def random(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype)


def decode_inputs(batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pages = batch * context // PAGE
    kv_layer = random(2, pages + 1, PAGE, KV_HEADS, HEAD_DIM)
    tables = (torch.randperm(pages, device="cuda") + 1).view(batch, context // PAGE)
    lens = torch.full((batch,), context, dtype=torch.long, device="cuda")
    return random(batch, Q_HEADS, HEAD_DIM), kv_layer, tables, lens


def native_paged_decode(
    q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """Torch-native paged attention: gather the pages, expand KV heads, then matmul, softmax, matmul."""
    batch, pages = tables.shape
    kv = kv_layer[:, tables].view(2, batch, pages * PAGE, KV_HEADS, HEAD_DIM)
    k = kv[0].transpose(1, 2).repeat_interleave(Q_HEADS // KV_HEADS, dim=1)  # [S, Hq, L, D]
    v = kv[1].transpose(1, 2).repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    scores = torch.matmul(q.unsqueeze(2), k.transpose(-1, -2)).float() * HEAD_DIM**-0.5  # [S, Hq, 1, L]
    scores.masked_fill_(
        torch.arange(pages * PAGE, device=q.device) >= lens[:, None, None, None], float("-inf")
    )
    return torch.matmul(scores.softmax(-1).to(q.dtype), v).squeeze(2)


def bench_row_kernels(backend: CupyBackend, copy_bw: float) -> list[dict]:
    rows = []
    x, residual, weight = random(TOKENS, HIDDEN), random(TOKENS, HIDDEN), random(HIDDEN)
    rows.append(
        (
            "rms_norm + residual",
            f"{TOKENS}x{HIDDEN}",
            5 * x.numel() * 2,
            graph_time(lambda: backend.rms_norm(x, weight, 1e-5, residual)),
        )
    )
    qkv = random(TOKENS, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, : Q_HEADS * HEAD_DIM].view(TOKENS, Q_HEADS, HEAD_DIM)
    k = qkv[:, Q_HEADS * HEAD_DIM : (Q_HEADS + KV_HEADS) * HEAD_DIM].view(TOKENS, KV_HEADS, HEAD_DIM)
    v = qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM :].view(TOKENS, KV_HEADS, HEAD_DIM)
    cos_sin = random(8192, 2, HEAD_DIM)
    positions = torch.randint(0, 8192, (TOKENS,), device="cuda")
    rotary_bytes = 2 * TOKENS * (Q_HEADS + KV_HEADS) * HEAD_DIM * 2 + TOKENS * 2 * HEAD_DIM * 2
    rows.append(
        (
            "rotary (q and k)",
            f"{TOKENS} tokens",
            rotary_bytes,
            graph_time(lambda: backend.rotary(q, k, positions, cos_sin)),
        )
    )
    kv_layer = random(2, TOKENS // PAGE + 1, PAGE, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(TOKENS, device="cuda") + PAGE  # skip the null page
    rows.append(
        (
            "kv_write",
            f"{TOKENS} tokens",
            4 * TOKENS * KV_HEADS * HEAD_DIM * 2,
            graph_time(lambda: backend.write_kv(kv_layer, k, v, slots)),
        )
    )
    gate_up = random(TOKENS, 2 * INTER)
    rows.append(
        (
            "silu_and_mul",
            f"{TOKENS}x{INTER}",
            3 * TOKENS * INTER * 2,
            graph_time(lambda: backend.silu_and_mul(gate_up)),
        )
    )
    return [
        {"kernel": n, "shape": s, "us": t * 1e6, "GB/s": b / t / 1e9, "of copy": b / t / copy_bw}
        for n, s, b, t in rows
    ]


# (warps, stages, min_partition): the default tuning first, then the alternatives the table weighs it against.
DECODE_TUNINGS = [(4, 3, 64), (8, 3, 64), (4, 2, 64), (4, 4, 64), (4, 3, 256)]


def bench_decode_batch(batch: int, copy_bw: float) -> list[dict]:
    """Paged decode of `batch` sequences of CONTEXT tokens, in each of DECODE_TUNINGS."""
    q, kv_layer, tables, lens = decode_inputs(batch, CONTEXT)
    kv_bytes = 2 * batch * CONTEXT * KV_HEADS * HEAD_DIM * 2
    out = torch.empty_like(q)

    def run(tuning: Tuning) -> None:
        cuda_ops.paged_decode(out, q, kv_layer, tables, lens, CONTEXT, LayerAttention(0.088), tuning)

    rows = []
    for warps, stages, minimum in DECODE_TUNINGS:
        tuning = Tuning(warps, minimum, prefill_warps=4, row_threads=256, decode_stages=stages)
        seconds = graph_time(functools.partial(run, tuning))
        rate = {"GB/s": kv_bytes / seconds / 1e9, "of copy": kv_bytes / seconds / copy_bw}
        name = f"paged_decode w{warps} s{stages} min{minimum}"
        rows.append({"kernel": name, "shape": f"{batch}x{CONTEXT}", "us": seconds * 1e6, **rate})
    return rows


def bench_decode(copy_bw: float) -> tuple[list[dict], dict]:
    """Paged decode at BATCH x CONTEXT and 1 x CONTEXT; the default tuning against torch-native at BATCH."""
    rows = [*bench_decode_batch(BATCH, copy_bw), *bench_decode_batch(1, copy_bw)]
    q, kv_layer, tables, lens = decode_inputs(BATCH, CONTEXT)
    out = torch.empty_like(q)
    cuda_ops.paged_decode(
        out, q, kv_layer, tables, lens, CONTEXT, LayerAttention(0.088), CupyBackend(q.device).tuning
    )
    reference = native_paged_decode(q, kv_layer, tables, lens)
    error = (out.float() - reference.float()).norm() / reference.float().norm()
    native = event_time(lambda: native_paged_decode(q, kv_layer, tables, lens)) * 1e6
    best = min(rows[: len(DECODE_TUNINGS)], key=lambda row: row["us"])
    summary = {"best": best["kernel"], "native_us": native, "speedup": native / best["us"]}
    return rows, {**summary, "rel_error": error.item()}


def prefill_meta(seqs: int, cached: int, new: int) -> AttentionMetadata:
    """A step of prefill chunks only: seqs sequences of `cached` tokens in the cache and `new` more."""
    from tests.kernels.steps import Chunk, make_metadata

    pages = ((torch.randperm(seqs * (cached + new) // PAGE) + 1).view(seqs, -1)).tolist()
    return make_metadata([], [Chunk(tuple(table), cached, new) for table in pages], PAGE, "cuda")


def bench_prefill(backend: CupyBackend, seqs: int, cached: int, new: int) -> dict:
    """TFLOP/s of the attention's matrix work (QK^T and PV, causal) over the pages of `seqs` sequences."""
    meta = prefill_meta(seqs, cached, new)
    kv_layer = random(2, seqs * (cached + new) // PAGE + 1, PAGE, KV_HEADS, HEAD_DIM)
    q = random(seqs * new, Q_HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    # Timed with events: the wrapper uploads its tile list, which a CUDA graph cannot capture.
    seconds = event_time(
        lambda: cuda_ops.paged_prefill(out, q, kv_layer, meta, LayerAttention(0.088), backend.tuning)
    )
    pairs = seqs * Q_HEADS * sum(cached + i + 1 for i in range(new))
    shape = f"{seqs}x({cached}+{new})" if cached else f"{seqs}x{new}"
    return {"kernel": "paged_prefill", "shape": shape, "us": seconds * 1e6,
            "TFLOP/s": 4 * pairs * HEAD_DIM / seconds / 1e12}  # fmt: skip


def bench_end_to_end() -> dict:
    """Output tokens/s of 64 concurrent greedy requests through `pagedserve up --device cuda`."""
    import concurrent.futures

    from services.client import Client
    from tests.models import make_model
    from tests.procs import start_stack

    run_dir = Path(tempfile.mkdtemp(prefix="ps-e2e-"))
    model = make_model(
        "llama",
        run_dir / "model",
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=8,
    )
    stack = start_stack(run_dir, "--device", "cuda", "--model", str(model), "--kv-memory", "4GiB")
    try:
        with Client(stack.address) as client:

            def one(i: int) -> int:
                reply = client.complete(
                    token_ids=list(range(3, 131)), max_tokens=128, ignore_eos=True, temperature=0.8, seed=i
                )
                return reply.usage.completion_tokens

            one(0)  # warm up
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                produced = sum(pool.map(one, range(64)))
            seconds = time.perf_counter() - start
    finally:
        stack.stop()
    return {"requests": 64, "output_tokens": produced, "seconds": seconds, "tokens/s": produced / seconds}


def table_line(row: dict) -> str:
    rate = (
        f"{row['GB/s']:>8.0f} {row['of copy']:>8.0%}" if "GB/s" in row else f"{row['TFLOP/s']:>7.1f} TFLOP/s"
    )
    return f"{row['kernel']:<28} {row['shape']:<16} {row['us']:>9.1f} {rate}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    backend = CupyBackend(torch.device("cuda"))
    copy_bw = copy_bandwidth()
    rows = bench_row_kernels(backend, copy_bw)
    decode_rows, decode = bench_decode(copy_bw)
    prefill = [bench_prefill(backend, 4, 512, 512), bench_prefill(backend, 1, 0, 8192)]
    e2e = None if args.skip_e2e else bench_end_to_end()
    print(f"\n{torch.cuda.get_device_name()}: device copy {copy_bw / 1e9:.0f} GB/s (read + write), {DTYPE}")
    print(f"{'kernel':<28} {'shape':<16} {'us':>9} {'GB/s':>8} {'of copy':>8}")
    for row in [*rows, *decode_rows, *prefill]:
        print(table_line(row))
    print(
        f"paged decode ({decode['best']}) against torch-native gather + matmul + softmax: "
        f"{decode['native_us']:.0f} us native, {decode['speedup']:.1f}x faster, "
        f"relative error {decode['rel_error']:.1e}"
    )
    if e2e:
        print(f"end to end through pagedserve up over CUDA IPC: {e2e['tokens/s']:.0f} output tokens/s")
    if args.json:
        results = {"copy_GBps": copy_bw / 1e9, "kernels": [*rows, *decode_rows], "prefill": prefill}
        args.json.write_text(json.dumps({**results, "decode": decode, "e2e": e2e}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
