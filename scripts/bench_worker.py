"""Benchmark the compute worker on SmolLM2-135M (or --model), fp32, on this CPU, beside transformers.

    python scripts/bench_worker.py [--model DIR] [--requests 16] [--prompt-tokens 128] [--output-tokens 64]

Every request is greedy and runs to exactly --output-tokens tokens. In one run it prints:
- output tokens/s of the engine (in-process pool, and the daemon's pool) and of a real worker process
  reached over gRPC;
- transformers' `generate` with one static batch, and `generate_batch` (its continuous batching);
- the engine's achieved model FLOP/s (2 x parameters x tokens processed / time) beside torch's GEMM rate at
  the very shapes the engine ran: the same GEMMs timed alone;
- the decode step time with the daemon's pool against the in-process pool.
Machines are noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from pagedserve.plumbing.rpc import wait_for_health  # noqa: E402
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from services.common.default_model import default_model_dir  # noqa: E402
from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.common.wire import sampling_to_pb  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.core.engine import EngineCore  # noqa: E402
from services.worker.core.engine_config import EngineConfig  # noqa: E402
from services.worker.kv.base import KVCache  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.kv.remote import DaemonKVCache  # noqa: E402
from services.worker.models import CausalLM, load_model  # noqa: E402
from services.worker.server import kernel_backend  # noqa: E402

KV_BYTES = 512 * 2**20
Step = tuple[int, int, float]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "knowledge travelled across Europe. Scholars, merchants and priests all found new uses for cheap books, "
    "and cities grew their own presses, guilds and libraries. "
)


def make_prompts(tokenizer: AutoTokenizer, count: int, length: int) -> list[list[int]]:
    ids = tokenizer(TEXT * (2 + count * length // 40))["input_ids"]
    return [ids[i * 7 : i * 7 + length] for i in range(count)]


def run_in_lockstep(
    engines: dict[str, EngineCore], prompts: list[list[int]], output_tokens: int
) -> dict[str, list[Step]]:
    """Generate the same requests on every engine, alternating their steps so that they share the machine's
    noise; return each engine's steps: (tokens, sampled rows, seconds)."""
    options = SamplingOptions(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    for engine in engines.values():
        for key, prompt in enumerate(prompts):
            engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), options)))
    steps: dict[str, list[Step]] = {name: [] for name in engines}
    while any(engine.has_unfinished() for engine in engines.values()):
        for name, engine in engines.items():
            if engine.has_unfinished():
                begin = time.perf_counter()
                engine.step()
                steps[name].append((*engine.last_batch, time.perf_counter() - begin))
    return steps


def gemm_seconds(model: CausalLM, tokens: int, rows: int, repeats: int = 3) -> float:
    """Time the forward pass's GEMMs alone, at one step's shapes: best of `repeats`."""
    w = model.weights
    x = torch.randn(tokens, model.spec.hidden_size)
    attn = torch.randn(tokens, model.spec.num_heads * model.spec.head_dim)
    mlp = torch.randn(tokens, model.spec.intermediate_size)
    head_in = torch.randn(rows, model.spec.hidden_size)
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        for layer in w.layers:
            F.linear(x, layer.qkv)
            F.linear(attn, layer.o)
            F.linear(x, layer.gate_up)
            F.linear(mlp, layer.down)
        F.linear(head_in, w.lm_head)
        best = min(best, time.perf_counter() - begin)
    return best


def worker_process_throughput(
    daemon: str, run_dir: Path, model_dir: Path, prompts: list[list[int]], output_tokens: int
) -> float:
    address = f"unix:{run_dir}/worker.sock"
    worker = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "worker", "--daemon", daemon, "--address", address,
         "--model", str(model_dir), "--kv-memory", str(KV_BYTES), "--log-level", "WARNING"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        wait_for_health(address, timeout_s=180)
        requests: queue.Queue[worker_pb2.WorkerRequest | None] = queue.Queue()
        options = sampling_to_pb(SamplingOptions(max_tokens=output_tokens, temperature=0.0, ignore_eos=True))
        with grpc.insecure_channel(address) as channel:
            replies = worker_pb2_grpc.WorkerStub(channel).Connect(iter(requests.get, None))
            # Warm up with one short request, then time the batch.
            requests.put(
                worker_pb2.WorkerRequest(
                    submit=[
                        worker_pb2.Submit(request_id="warm", prompt_token_ids=prompts[0], sampling=options)
                    ]
                )
            )
            for reply in replies:
                if any(o.finish_reason for o in reply.outputs):
                    break
            start = time.perf_counter()
            submits = [
                worker_pb2.Submit(request_id=str(i), prompt_token_ids=p, sampling=options)
                for i, p in enumerate(prompts)
            ]
            requests.put(worker_pb2.WorkerRequest(submit=submits))
            pending, produced = len(prompts), 0
            for reply in replies:
                for output in reply.outputs:
                    produced += len(output.token_ids)
                    pending -= bool(output.finish_reason)
                if not pending:
                    break
            elapsed = time.perf_counter() - start
            requests.put(None)
        return produced / elapsed
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def engine_throughputs(
    model: CausalLM, model_dir: Path, config: EngineConfig, prompts: list[list[int]], out_len: int
) -> tuple[dict[str, float], dict[str, list[Step]]]:
    """Output tokens/s of the engine core on an in-process pool and on the daemon's, stepped in turn, and
    of a real worker process over gRPC; and the two cores' step logs."""
    spec = model.spec
    shape = spec.pool_shape("float32", 16)
    run_dir = Path(tempfile.mkdtemp(prefix="ps-bench-"))
    daemon_address = f"unix:{run_dir}/daemon.sock"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "memory_daemon", "--address", daemon_address, "--log-level", "WARNING"],
        cwd=ROOT,
    )
    results: dict[str, float] = {}
    try:
        wait_for_health(daemon_address, timeout_s=30)
        caches: dict[str, KVCache] = {
            "in-process pool": LocalKVCache(shape, KV_BYTES // shape.page_bytes),
            "daemon pool": DaemonKVCache(
                daemon_address, model_id="bench", shape=shape, memory_bytes=KV_BYTES
            ),
        }
        engines = {name: EngineCore(model, kv, config) for name, kv in caches.items()}
        run_in_lockstep(engines, prompts[:2], 4)  # warm up
        step_logs = run_in_lockstep(engines, prompts, out_len)
        for name, steps in step_logs.items():
            results[f"engine, {name}"] = len(prompts) * out_len / sum(seconds for _, _, seconds in steps)
            caches[name].close()
        results["worker process over gRPC"] = worker_process_throughput(
            daemon_address, run_dir, model_dir, prompts, out_len
        )
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    return results, step_logs


def hf_throughputs(model_dir: Path, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    """Output tokens/s of transformers' static-batch generate and of generate_batch."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    batch = torch.tensor(prompts)
    results: dict[str, float] = {}
    with torch.inference_mode():
        hf.generate(batch[:2], max_new_tokens=4, do_sample=False)  # warm up
        start = time.perf_counter()
        hf.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
        )
        results["HF generate, static batch"] = len(prompts) * out_len / (time.perf_counter() - start)
        generation = GenerationConfig(
            max_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        start = time.perf_counter()
        produced = hf.generate_batch(inputs=prompts, generation_config=generation, max_new_tokens=out_len)
        elapsed = time.perf_counter() - start
        results["HF generate_batch"] = sum(len(o.generated_tokens) for o in produced.values()) / elapsed
    return results


def print_gemm_share(model: CausalLM, steps: list[Step]) -> None:
    """The engine's model FLOP/s beside torch's GEMM rate at the same shapes, overall and by phase."""
    spec = model.spec
    if any(layer.experts is not None for layer in model.weights.layers):  # GEMMs over each expert's tokens
        print("\nmodel FLOP/s: not reported for a mixture of experts")
        return
    gemm = {shape: gemm_seconds(model, *shape) for shape in {(tokens, rows) for tokens, rows, _ in steps}}
    print(
        f"\nmodel FLOP/s = 2 x {spec.num_parameters / 1e6:.1f}M parameters x tokens processed / time"
        " (in-process pool)"
    )
    print(
        f"{'steps':<22} {'tokens':>7} {'engine GFLOP/s':>15} {'torch GEMM GFLOP/s':>19} {'engine / GEMM':>14}"
    )
    phases = {
        "all": steps,
        "with prefill": [step for step in steps if step[0] > step[1]],
        "decode only": [step for step in steps if step[0] == step[1]],
    }
    for label, chosen in phases.items():
        processed = sum(tokens for tokens, _, _ in chosen)
        flops = 2 * spec.num_parameters * processed
        engine_time = sum(seconds for _, _, seconds in chosen)
        gemm_time = sum(gemm[(tokens, rows)] for tokens, rows, _ in chosen)
        rates = f"{flops / engine_time / 1e9:>15.1f} {flops / gemm_time / 1e9:>19.1f}"
        print(f"{label:<22} {processed:>7} {rates} {gemm_time / engine_time:>14.1%}")
    print("target: 85% or more of the GEMM rate")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=EngineConfig().max_batched_tokens)
    args = parser.parse_args()
    n, out_len = args.requests, args.output_tokens
    torch.manual_seed(0)
    model_dir = args.model or default_model_dir()
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), n, args.prompt_tokens)
    cpu = torch.device("cpu")
    backend = kernel_backend(WorkerConfig(device="cpu"), cpu)  # the worker's own choice: the C++ ops
    model = load_model(model_dir, dtype=torch.float32, device=cpu, backend=backend)
    config = EngineConfig(
        max_batched_tokens=args.max_batched_tokens, max_num_seqs=max(n, 16), prefix_caching=False
    )
    threads = torch.get_num_threads()
    print(f"{model.spec.model_type} ({model_dir.name}) fp32, {backend.name} kernels, {threads} threads: "
          f"{n} requests x {args.prompt_tokens} prompt tokens "
          f"-> {out_len} output tokens, greedy; max_batched_tokens {config.max_batched_tokens}")  # fmt: skip
    results, step_logs = engine_throughputs(model, model_dir, config, prompts, out_len)
    results |= hf_throughputs(model_dir, prompts, out_len)
    print(f"\n{'output tokens/s':<34} {'tok/s':>8} {'vs HF static':>13}")
    for name, rate in results.items():
        print(f"{name:<34} {rate:>8.1f} {rate / results['HF generate, static batch']:>12.2f}x")
    print_gemm_share(model, step_logs["in-process pool"])
    # The two engines stepped in turn, so step i of one ran right beside step i of the other: the median of
    # the paired ratios cancels most of the machine's drift.
    decode = {name: [s for t, r, s in log if t == r == n] for name, log in step_logs.items()}
    local, remote = decode["in-process pool"], decode["daemon pool"]
    paired = statistics.median(b / a for a, b in zip(local, remote, strict=False))
    print(f"\ndecode step, {n} sequences: in-process pool {statistics.median(local) * 1e3:.1f} ms, "
          f"daemon pool {statistics.median(remote) * 1e3:.1f} ms (medians); "
          f"daemon / in-process, median of paired steps: {paired:.3f} (target: 1.02 or less)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
