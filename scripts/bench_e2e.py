"""End to end: `pagedserve up` against transformers' `generate`, on one random Llama, in one run.

    python scripts/bench_e2e.py [--device cuda] [--layers 32] [--hidden 4096] [--inter 14336]
                                [--heads 32] [--kv-heads 8] [--requests 64] [--prompt 512] [--output 256]
                                [--kv-memory 40GiB]

The defaults are an 8B-shaped Llama (bf16 on a GPU, float32 on a CPU), as issue 19 measures it:
- output tokens/s of --requests concurrent greedy requests of --prompt tokens, each run to --output tokens,
  through `pagedserve up` (the frontend, a worker, the daemon's pool);
- one request alone: its inter-token latency (the median gap between streamed tokens), beside the
  weight-read floor: the weights' bytes over the bandwidth of a device copy of as many bytes, measured here;
- transformers' `generate` on the same model and prompts, one static batch, after the stack has stopped.
Small shapes run it on a CPU: --device cpu --layers 2 --hidden 256 --inter 512 --heads 4 --kv-heads 2 ...
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.client import Client  # noqa: E402
from tests.models import make_model  # noqa: E402
from tests.procs import start_stack  # noqa: E402


def prompts(count: int, length: int) -> list[list[int]]:
    """Distinct prompts of token ids (no two share a prefix page, so the prefix cache does not help)."""
    return [[(97 * i + 13 * j) % 30000 + 3 for j in range(length)] for i in range(count)]


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Bytes moved per second (read and written) by a copy of `size` bytes on the device, as
    scripts/bench_kernels.py counts it."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times)


def serve(args: argparse.Namespace, model: Path, batch: list[list[int]]) -> dict:
    """Throughput of the batch, then one request's inter-token latency, through `pagedserve up`."""
    run_dir = Path(tempfile.mkdtemp(prefix="ps-e2e-"))
    flags = ["--device", args.device, "--model", str(model), "--kv-memory", args.kv_memory]
    stack = start_stack(run_dir, *flags, "--max-num-seqs", str(args.requests), timeout_s=900)
    try:
        with Client(stack.address) as client:

            def one(prompt: list[int]) -> int:
                reply = client.complete(
                    token_ids=prompt, max_tokens=args.output, ignore_eos=True, temperature=0
                )
                return reply.usage.completion_tokens

            one(batch[0][:16])  # warm up
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                produced = sum(pool.map(one, batch))
            seconds = time.perf_counter() - start
            gaps, last = [], None
            for reply in client.stream(
                token_ids=batch[0], max_tokens=args.output, ignore_eos=True, temperature=0
            ):
                now = time.perf_counter()
                if last is not None and reply.token_ids:
                    gaps.append((now - last) / len(reply.token_ids))
                last = now
    finally:
        stack.stop()
    return {"tokens/s": produced / seconds, "itl_s": statistics.median(gaps)}


def transformers_generate(
    args: argparse.Namespace, model: Path, batch: list[list[int]], dtype: torch.dtype
) -> float:
    """Output tokens/s of transformers' generate: the batch at once, greedy, to exactly --output tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(args.device).eval()
    ids = torch.tensor(batch, device=args.device)
    with torch.inference_mode():
        hf.generate(ids[:, :16], max_new_tokens=2, do_sample=False)  # warm up
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=args.output, min_new_tokens=args.output, do_sample=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del hf
    return produced / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name, default in (("layers", 32), ("hidden", 4096), ("inter", 14336), ("heads", 32), ("kv-heads", 8),
                          ("requests", 64), ("prompt", 512), ("output", 256)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--kv-memory", default="40GiB")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folder = Path(tempfile.mkdtemp(prefix="ps-e2e-model-"))
    make_model("llama", folder, hidden_size=args.hidden, intermediate_size=args.inter,
               num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
               head_dim=args.hidden // args.heads, num_hidden_layers=args.layers,
               vocab_size=32000, dtype=dtype)  # fmt: skip
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    floor = weight_bytes / copy_bandwidth(device, min(weight_bytes, 4 << 30))  # seconds to read them once
    batch = prompts(args.requests, args.prompt)
    ours = serve(args, folder, batch)
    theirs = transformers_generate(args, folder, batch, dtype)
    shape = f"{args.layers} layers x {args.hidden}, GQA {args.heads}/{args.kv_heads}, {dtype}, {device}"
    print(f"\n{shape}: {weight_bytes / 1e9:.1f} GB of weights")
    work = f"{args.requests} x ({args.prompt} + {args.output})"
    print(f"pagedserve up, {work}: {ours['tokens/s']:.0f} output tokens/s")
    print(f"transformers generate, one batch of {args.requests}: {theirs:.0f} output tokens/s "
          f"({ours['tokens/s'] / theirs:.2f}x)")  # fmt: skip
    print(f"batch 1 inter-token latency {ours['itl_s'] * 1e3:.2f} ms, weight-read floor {floor * 1e3:.2f} ms "
          f"({ours['itl_s'] / floor:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
