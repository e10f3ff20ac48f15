"""Where a decode step's time goes: the engine core's phases, timed on the host, on a random Llama; steps
run one by one, then with async scheduling (the next step launched before this one's tokens are back).

    python scripts/bench_step.py [--device cpu|cuda] [--batch 64] [--prompt 128] [--steps 32]
                                 [--layers 8] [--hidden 1024] [--kv-heads 4]     (head dim 64)

Starts --batch greedy requests in one EngineCore (an in-process pool; CUDA graphs on a GPU, as a worker has
them), runs them past their prefills, then times --steps decode steps, each split into the host's time in:
- schedule: the scheduler's plan;
- build: the batch's tensors and attention metadata, and their upload;
- forward: the model (on a GPU, the graph replay's launch), and draw: the sampling's launch;
- wait: the host waiting for the tokens (on a GPU, for the device; nil on a CPU, which computed them already);
- postprocess (the outputs, their fan-out into each request).
On a GPU, what is not `wait` is the host's overhead; with async scheduling it overlaps the device's work.
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

from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.core import model_runner  # noqa: E402
from services.worker.core.cuda_graphs import DecodeGraphs  # noqa: E402
from services.worker.core.engine import EngineCore  # noqa: E402
from services.worker.core.engine_config import EngineConfig  # noqa: E402
from services.worker.core.sampler import Draw  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.models import CausalLM, load_model  # noqa: E402
from services.worker.server import kernel_backend  # noqa: E402
from tests.models import make_model  # noqa: E402

PAGE = 16
PHASES = ("schedule", "build", "forward", "draw", "wait", "postprocess")


class Phases:
    """Seconds per phase of the steps being timed; `timing` turns it off for the warm-up."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.timing = False

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            if not self.timing:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.seconds[phase].append(time.perf_counter() - start)
            return result

        return timed


def build_model(args: argparse.Namespace, device: torch.device, folder: Path) -> CausalLM:
    heads = args.hidden // 64  # head dim 64
    make_model("llama", folder, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
               num_attention_heads=heads, num_key_value_heads=args.kv_heads, head_dim=64,
               num_hidden_layers=args.layers)  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = kernel_backend(WorkerConfig(device=device.type), device)
    return load_model(folder, dtype=dtype, device=device, backend=backend)


def build_engine(args: argparse.Namespace, model: CausalLM, scheduling: str) -> EngineCore:
    spec, device = model.spec, model.device
    dtype = "bfloat16" if device.type == "cuda" else "float32"  # as build_model loads it
    shape = spec.pool_shape(dtype, PAGE)
    pages = args.batch * (-(-(args.prompt + args.steps + 16) // PAGE)) + 8
    kv = LocalKVCache(shape, pages, device=device)
    config = EngineConfig(
        max_batched_tokens=max(1024, args.batch), max_num_seqs=args.batch, async_scheduling=scheduling
    )
    graphs = None
    if device.type == "cuda":
        graphs = DecodeGraphs(model, kv.kv, args.batch, PAGE)
        graphs.capture()
    return EngineCore(model, kv, config, graphs)


def instrument(phases: Phases, model: CausalLM) -> None:
    """Times the phases by wrapping what every step calls: the model, model_runner's imports, the draw."""
    model.forward = phases.wrap("forward", model.forward)  # type: ignore[method-assign]
    model_runner.build_batch = phases.wrap("build", model_runner.build_batch)  # type: ignore[assignment]
    model_runner.draw = phases.wrap("draw", model_runner.draw)  # type: ignore[assignment]
    Draw.samples = phases.wrap("wait", Draw.samples)  # type: ignore[method-assign]


def instrument_engine(phases: Phases, engine: EngineCore) -> None:
    engine.scheduler.schedule = phases.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.scheduler.postprocess = phases.wrap("postprocess", engine.scheduler.postprocess)  # type: ignore[method-assign]
    if engine.runner.graphs is not None:
        engine.runner.graphs.run = phases.wrap("forward", engine.runner.graphs.run)  # type: ignore[method-assign]


def time_steps(args: argparse.Namespace, engine: EngineCore, phases: Phases) -> float:
    """The median decode step's seconds, once every request decodes; phases holds each phase's."""
    options = SamplingOptions(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for key in range(args.batch):
        prompt = [(7 * key + i) % 1000 + 3 for i in range(args.prompt)]
        engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), options)))
    while engine.last_batch[0] != args.batch:  # the prefills, until every request decodes
        engine.step()
    engine.step()  # a decode step, warm
    steps = []
    phases.timing = True
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    phases.timing = False
    engine.abort_all()
    return statistics.median(steps)


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
    model = build_model(args, device, Path(tempfile.mkdtemp(prefix="ps-step-")))
    phases = Phases()
    instrument(phases, model)
    print(f"{args.batch} decodes a step, {args.layers} layers x {args.hidden} wide, {device}:")
    medians = {}
    for scheduling, name in (("off", "one by one"), ("on", "async scheduling")):
        engine = build_engine(args, model, scheduling)
        instrument_engine(phases, engine)
        phases.seconds.clear()
        medians[scheduling] = step = time_steps(args, engine, phases)
        print(f"{name}: median step {step * 1e6:.0f} us ({args.batch / step:.0f} tokens/s)")
        for phase in PHASES:
            median = statistics.median(phases.seconds[phase]) if phases.seconds[phase] else 0.0
            print(f"  {phase:<12} {median * 1e6:>9.0f} us  {median / step:>6.1%}")
    print(f"async scheduling's step time / one by one's: {medians['on'] / medians['off']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
