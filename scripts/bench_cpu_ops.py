"""Benchmark the C++ CPU ops against torch on this machine: the few-row GEMM, then whole decode steps.

    python scripts/bench_cpu_ops.py [--threads 2] [--rows 1,2,4,8,16,32]
        [--parts gemm,experts,decode,prefill,steps]

1. GEMMs of SmolLM2-135M's layer shapes, with a separate weight per layer (30 layers, 424 MB) so that they
   stream from memory as in a decode step: MKL's F.linear against skinny_linear and, on the weights packed
   as a float32 model's are at load, packed_float_linear, per number of rows.
2. A mixture of experts' layer shaped as one of Qwen3-30B-A3B's, narrower (64 experts of 1024 x 384, 8 a
   token; 302 MB, so that it streams from memory): the torch reference against the C++ op, per row count.
3. Paged decode attention in bfloat16 over SmolLM2-135M's 30 layers' pools (3 KV heads of 64, 9 query heads,
   480 tokens a sequence on pages of 16 scattered over the pool): the C++ op with its keys scored in float32
   and, where this CPU runs it, with vdpbf16ps; ms for the 30 layers and the K and V bytes read a second.
4. Paged prefill attention, SmolLM2-135M's shape, prompts of 512 new tokens (1 and 4 of them) on pages of
   16: the C++ op in float32 (queries and pool), then in bfloat16 with float32 sums, with vdpbf16ps products
   where this CPU runs them, and on AMX's tiles where they run; ms for 30 layers.
5. Decode steps of the engine on SmolLM2-135M, fp32, with that many sequences (prompts of 64-128 tokens):
   the torch reference backend against the C++ one, median step time.
Machines are noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels.backend import ExpertWeights, KernelBackend, Routing  # noqa: E402
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops, pack_linear  # noqa: E402
from pagedserve.kernels.cpu_features import cpu_features  # noqa: E402
from pagedserve.kernels.torch_ref import TorchBackend  # noqa: E402
from services.common.default_model import default_model_dir  # noqa: E402
from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.worker.core.engine import EngineCore  # noqa: E402
from services.worker.core.engine_config import EngineConfig  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.models import CausalLM, load_model  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # QKV, O, gate-up, down: [N, K]


def seconds(run: Callable[[], object], repeats: int) -> float:
    run()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def bench_gemms(ops: ModuleType, rows: list[int]) -> None:
    weights = [torch.randn(n, k) for _ in range(30) for n, k in LAYER_SHAPES]
    packed = [pack_linear(w, ops.packed_float_group()) for w in weights]  # as a float32 model's, at load
    print("| rows | MKL F.linear ms | skinny_linear ms | packed_float_linear ms | MKL / packed |")
    print("|---|---|---|---|---|")
    for m in rows:
        inputs = {k: torch.randn(m, k) for k in (576, 1536)}
        pairs = [(inputs[w.shape[1]], w) for w in weights]
        mkl = seconds(lambda pairs=pairs: [F.linear(x, w) for x, w in pairs], 10)
        skinny = seconds(lambda pairs=pairs: [ops.skinny_linear(x, w, None, None) for x, w in pairs], 10)
        ours = seconds(
            lambda pairs=pairs: [
                ops.packed_float_linear(x, p.data, None, p.rows, False)
                for (x, _), p in zip(pairs, packed, strict=True)
            ],
            10,
        )
        print(f"| {m} | {mkl * 1e3:.1f} | {skinny * 1e3:.1f} | {ours * 1e3:.1f} | {mkl / ours:.2f}x |")


def bench_experts(ops: ModuleType, rows: list[int]) -> None:
    experts, hidden, inner = 64, 1024, 384
    weights = ExpertWeights(
        router=torch.randn(experts, hidden),
        gate_up=torch.randn(experts, 2 * inner, hidden) * 0.05,
        down=torch.randn(experts, hidden, inner) * 0.05,
    )
    routing = Routing(8, renormalize=True)
    reference, ours = TorchBackend(), CpuBackend(ops)
    print("\n| rows | torch reference moe ms | C++ moe ms | ratio |\n|---|---|---|---|")
    for m in rows:
        x = torch.randn(m, hidden)
        slow = seconds(lambda x=x: reference.moe(x, weights, routing), 10)
        fast = seconds(lambda x=x: ours.moe(x, weights, routing), 10)
        print(f"| {m} | {slow * 1e3:.1f} | {fast * 1e3:.1f} | {slow / fast:.2f}x |")


def bench_decode_attention(ops: ModuleType, rows: list[int], dot_bf16: bool) -> None:
    layers, page_size, kv_heads, group, dim, context = 30, 16, 3, 3, 64, 480
    ways = [False, True] if dot_bf16 else [False]
    names = " | ".join(f"{'vdpbf16ps' if dot else 'float32'} scores ms | GB/s" for dot in ways)
    print(f"\n| sequences | {names} |\n|---|{'---|---|' * len(ways)}")
    for n in rows:
        per_sequence = -(-context // page_size)
        pages = n * per_sequence + 1
        pools = [torch.randn(2, pages, page_size, kv_heads, dim).bfloat16() for _ in range(layers)]
        tables = (torch.randperm(pages - 1)[: n * per_sequence] + 1).view(n, per_sequence)
        lens = torch.full((n,), context)
        q = torch.randn(n, kv_heads * group, dim).bfloat16()
        read = layers * n * context * kv_heads * dim * 2 * 2  # K and V, bfloat16
        cells = []
        for dot in ways:
            args = (tables, lens, dim**-0.5, 0, 0.0, None, dot)
            ms = 1e3 * seconds(lambda q=q, p=pools, a=args: [ops.paged_decode(q, kv, *a) for kv in p], 10)
            cells.append(f"{ms:.1f} | {read / ms / 1e6:.1f}")
        print(f"| {n} | {' | '.join(cells)} |")


def bench_prefill_attention(ops: ModuleType, dot_bf16: bool, amx: bool) -> None:
    page_size, kv_heads, group, dim, prompt = 16, 3, 3, 64, 512
    # The dtype of the queries and the pool, and paged_prefill's (dot_bf16, amx), for each way.
    ways = {
        "float32": (torch.float32, False, False),
        "bfloat16, float32 sums": (torch.bfloat16, False, False),
    }
    if dot_bf16:
        ways["vdpbf16ps"] = (torch.bfloat16, True, False)
    if dot_bf16 and amx:
        ways["AMX tiles"] = (torch.bfloat16, True, True)
    names = " | ".join(f"{name} ms" for name in ways)
    print(f"\n| prompts of {prompt} | {names} |\n|---|{'---|' * len(ways)}")
    for n in (1, 4):
        pages = n * prompt // page_size
        kv = torch.randn(2, pages, page_size, kv_heads, dim)
        tables = torch.randperm(pages).view(n, pages // n)
        lens, starts = torch.full((n,), prompt), torch.arange(n + 1) * prompt
        q = torch.randn(n * prompt, kv_heads * group, dim)
        cells = []
        for dtype, *flags in ways.values():
            args = (q.to(dtype), kv.to(dtype), tables, lens, starts, dim**-0.5, 0, 0.0, None, *flags)
            cells.append(f"{1e3 * 30 * seconds(lambda a=args: ops.paged_prefill(*a), 10):.1f}")
        print(f"| {n} | {' | '.join(cells)} |")


def decode_step_ms(model: CausalLM, sequences: int, steps: int = 20) -> float:
    spec = model.spec
    kv = LocalKVCache(spec.pool_shape("float32", 16), 2048)
    engine = EngineCore(model, kv, EngineConfig(max_batched_tokens=4096, max_num_seqs=64))
    rng = random.Random(0)
    options = SamplingOptions(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for key in range(sequences):
        engine.add(
            engine.new_sequence(
                key,
                EngineRequest(tuple(rng.randrange(100, 40000) for _ in range(rng.randint(64, 128))), options),
            )
        )
    engine.step()  # every prompt in one prefill step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_steps(backends: dict[str, KernelBackend], rows: list[int]) -> None:
    models = {
        name: load_model(
            default_model_dir(), dtype=torch.float32, device=torch.device("cpu"), backend=backend
        )
        for name, backend in backends.items()
    }
    print(f"\n| sequences | {' | '.join(f'{name} step ms' for name in models)} | ratio |\n|---|---|---|---|")
    for n in rows:
        ms = [decode_step_ms(model, n) for model in models.values()]
        print(f"| {n} | {' | '.join(f'{t:.1f}' for t in ms)} | {ms[0] / ms[-1]:.2f}x |")


PARTS = ("gemm", "experts", "decode", "prefill", "steps")  # the tables above, in order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's choice")
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--parts", default=",".join(PARTS), help="which of the tables above to run")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    ops = cpu_ops()
    if ops is None:
        print("the C++ CPU ops could not be built here", file=sys.stderr)
        return 1
    print(f"{torch.get_num_threads()} threads\n")
    features = cpu_features()
    if "gemm" in parts:
        bench_gemms(ops, rows)
    if "experts" in parts:
        bench_experts(ops, rows)
    if "decode" in parts:
        bench_decode_attention(ops, rows, features.avx512_bf16.usable)
    if "prefill" in parts:
        bench_prefill_attention(ops, features.avx512_bf16.usable, features.amx_bf16.usable)
    if "steps" in parts:
        bench_steps({"torch": TorchBackend(), "cpu": CpuBackend(ops)}, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
