"""Where a decode step's time goes: the engine core's phases, timed on the host, on a random Llama.

    python scripts/bench_step.py [--device cpu|cuda] [--batch 64] [--prompt 128] [--steps 32]
                                 [--layers 8] [--hidden 1024] [--kv-heads 4]     (head dim 64)

Starts --batch greedy requests in one EngineCore (an in-process pool; CUDA graphs on a GPU, as a worker has
them), runs them past their prefills, then times --steps decode steps, each split into:
- schedule: the scheduler's plan;
- build: the batch's tensors and attention metadata, and their upload;
- forward: the model's host time (on a GPU, the graph replay's launch), then `device wait`: a synchronize,
  so that what the device still had to do shows apart from the host's own work;
- sample, and postprocess (the outputs, their fan-out into each request).
On a CPU the forward is the computation itself and `device wait` is nil. The rest of a step is the host's
overhead, which a GPU leaves it to hide.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory_daemon.shape import PoolShape  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.core import model_runner  # noqa: E402
from services.worker.core.cuda_graphs import DecodeGraphs  # noqa: E402
from services.worker.core.engine import EngineConfig, EngineCore  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.models import CausalLM  # noqa: E402
from services.worker.server import kernel_backend  # noqa: E402
from tests.models import make_model  # noqa: E402

PAGE = 16
PHASES = ("schedule", "build", "forward", "device wait", "sample", "postprocess")


class Phases:
    """Seconds per phase of the step being timed; `timing` turns it off for the warm-up."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.timing = False

    def wrap(self, phase: str, fn: Callable, then_wait: bool = False) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            if not self.timing:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.seconds[phase].append(time.perf_counter() - start)
            if then_wait:
                start = time.perf_counter()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.seconds["device wait"].append(time.perf_counter() - start)
            return result

        return timed


def build_engine(args: argparse.Namespace, device: torch.device, folder: Path) -> EngineCore:
    heads = args.hidden // 64  # head dim 64
    make_model("llama", folder, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
               num_attention_heads=heads, num_key_value_heads=args.kv_heads, head_dim=64,
               num_hidden_layers=args.layers)  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = kernel_backend(WorkerConfig(device=device.type), device)
    model = CausalLM.from_pretrained(folder, dtype=dtype, device=device, backend=backend)
    spec = model.spec
    shape = PoolShape(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, str(dtype).removeprefix("torch."), PAGE
    )
    pages = args.batch * (-(-(args.prompt + args.steps + 16) // PAGE)) + 8
    kv = LocalKVCache(shape, pages, device=device)
    config = EngineConfig(max_batched_tokens=max(1024, args.batch), max_num_seqs=args.batch)
    graphs = None
    if device.type == "cuda":
        graphs = DecodeGraphs(model, kv.kv, args.batch, PAGE)
        graphs.capture()
    return EngineCore(model, kv, config, graphs)


def instrument(engine: EngineCore, phases: Phases) -> None:
    """Times each phase by wrapping what the step calls (the engine's objects, and model_runner's imports)."""
    engine.scheduler.schedule = phases.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.scheduler.postprocess = phases.wrap("postprocess", engine.scheduler.postprocess)  # type: ignore[method-assign]
    runner = engine.runner
    runner.model.forward = phases.wrap("forward", runner.model.forward, then_wait=True)  # type: ignore[method-assign]
    if runner.graphs is not None:
        runner.graphs.run = phases.wrap("forward", runner.graphs.run, then_wait=True)  # type: ignore[method-assign]
    model_runner.build_batch = phases.wrap("build", model_runner.build_batch)  # type: ignore[assignment]
    model_runner.sample = phases.wrap("sample", model_runner.sample)  # type: ignore[assignment]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()
    device = torch.device(args.device)
    engine = build_engine(args, device, Path(tempfile.mkdtemp(prefix="ps-step-")))
    phases = Phases(device)
    instrument(engine, phases)
    options = SamplingOptions(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    for key in range(args.batch):
        prompt = [(7 * key + i) % 1000 + 3 for i in range(args.prompt)]
        engine.add(engine.new_sequence(key, prompt, options))
    while engine.last_batch[0] != args.batch:  # the prefills, until every request decodes
        engine.step()
    engine.step()  # a decode step, warm
    steps = []
    phases.timing = True
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    print(f"{args.batch} decodes a step, {args.layers} layers x {args.hidden} wide, {device}: "
          f"median step {step * 1e6:.0f} us ({args.batch / step:.0f} tokens/s)")  # fmt: skip
    for phase in PHASES:
        median = statistics.median(phases.seconds[phase]) if phases.seconds[phase] else 0.0
        print(f"  {phase:<12} {median * 1e6:>9.0f} us  {median / step:>6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
