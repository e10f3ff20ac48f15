"""Benchmark the torch backend's decode on the CPU: decodes grouped by length against one padded group.

    python scripts/bench_decode_groups.py [--requests 32] [--min-prompt 64] [--max-prompt 900]

SmolLM2-135M, fp32. The requests' prompts have random lengths; once they are all prefilled, the engine's
decode steps run in blocks that alternate between the two backends, so that both share the machine's noise.
Each block starts with two untimed steps: a switch changes the sizes the allocator is asked for, and its
first steps pay for that. It prints each one's median decode step and their ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels.torch_ref import TorchBackend  # noqa: E402
from services.common.default_model import default_model_dir  # noqa: E402
from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.worker.core.engine import EngineCore  # noqa: E402
from services.worker.core.engine_config import EngineConfig  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.models import load_model  # noqa: E402

ONE_GROUP = 2**62  # a group cost no padding outweighs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=900)
    parser.add_argument("--blocks", type=int, default=3, help="blocks of steps for each backend")
    parser.add_argument("--steps", type=int, default=4, help="decode steps timed in each block")
    args = parser.parse_args()
    rng = random.Random(0)
    lengths = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.requests)]
    grouped, padded = TorchBackend(), TorchBackend(group_cost=ONE_GROUP)
    model = load_model(default_model_dir(), dtype=torch.float32, device=torch.device("cpu"), backend=grouped)
    spec = model.spec
    shape = spec.pool_shape("float32", 16)
    kv = LocalKVCache(shape, 3 * 2**30 // shape.page_bytes)
    engine = EngineCore(model, kv, EngineConfig(max_num_seqs=args.requests, prefix_caching=False))
    options = SamplingOptions(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    for key, length in enumerate(lengths):
        engine.add(
            engine.new_sequence(
                key,
                EngineRequest(tuple(rng.randint(100, spec.vocab_size - 1) for _ in range(length)), options),
            )
        )
    decode_step = (args.requests, args.requests)  # (tokens, sampled rows): every request decodes
    while engine.last_batch != decode_step:
        engine.step()  # prefill every prompt
    times: dict[str, list[float]] = {"grouped by length": [], "one padded group": []}
    for _ in range(args.blocks):
        for name, backend in zip(times, (grouped, padded), strict=True):
            model.backend = backend
            engine.step(), engine.step()
            for _ in range(args.steps):
                begin = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - begin)
                assert engine.last_batch == decode_step, engine.last_batch
    print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads: {args.requests} decodes at "
          f"{min(lengths)}-{max(lengths)} prompt tokens, {args.blocks * args.steps} steps each")  # fmt: skip
    medians = {name: statistics.median(steps) for name, steps in times.items()}
    for name, median in medians.items():
        print(f"{name:<20} decode step {median * 1e3:8.1f} ms (median)")
    print(f"one padded group / grouped: {medians['one padded group'] / medians['grouped by length']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
