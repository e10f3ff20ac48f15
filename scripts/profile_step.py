"""Where a decode (or prefill) step's time goes on this CPU: the engine's step on the default model, with
each kernel backend operation timed, for each precision the worker serves here.

    python scripts/profile_step.py [--sequences 1,12,32] [--context 480] [--precisions bfloat16,int8-bfloat16]
        [--prefill]

Each sequence has a prompt of --context random tokens, prefilled first, in one step; then ten decode steps
are timed (or, with --prefill, that prefill step, once warmed up on other prompts): the whole step and each
backend operation (OPERATIONS), with the C++ CPU kernels and the instructions the worker would use here
(pagedserve/kernels/cpu_features.py). What the operations leave of the step is the engine's own work:
batching, sampling and the model's Python.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory_daemon.shape import DType  # noqa: E402
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops  # noqa: E402
from pagedserve.kernels.cpu_features import cpu_features  # noqa: E402
from services.common.default_model import default_model_dir  # noqa: E402
from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.worker.core.engine import EngineCore  # noqa: E402
from services.worker.core.engine_config import EngineConfig  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from services.worker.quantization import Quantization  # noqa: E402

OPERATIONS = ("linear", "gated_linear", "paged_attention", "rms_norm", "rotary", "silu_and_mul", "write_kv")
# The model's dtype, its weights' quantization, and its pool's dtype.
PRECISIONS: dict[str, tuple[torch.dtype, Quantization, DType]] = {
    "float32": (torch.float32, "none", "float32"),
    "float32-kv-bfloat16": (torch.float32, "none", "bfloat16"),
    "bfloat16": (torch.bfloat16, "none", "bfloat16"),
    "int8-bfloat16": (torch.bfloat16, "int8", "bfloat16"),
    "int8-float32": (torch.float32, "int8", "float32"),
}
STEPS = 10


@contextmanager
def timed(backend: CpuBackend, seconds: Counter[str]) -> Iterator[None]:
    """Adds each operation's wall time on backend into seconds while the block runs; an operation that runs
    others (gated_linear, where it is linear and silu_and_mul) counts as itself alone."""
    running: list[str] = []

    def wrap(name: str, run: Callable[..., object]) -> Callable[..., object]:
        def timed_run(*args: object, **kwargs: object) -> object:
            if running:
                return run(*args, **kwargs)
            running.append(name)
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
                running.pop()

        return timed_run

    for name in OPERATIONS:
        setattr(backend, name, wrap(name, getattr(backend, name)))
    try:
        yield
    finally:
        for name in OPERATIONS:
            delattr(backend, name)  # the class's own method again


def profile(precision: str, sequences: int, context: int, prefill: bool = False) -> dict[str, float]:
    """Milliseconds a decode step (or the prefill step): the whole step, and each operation's share."""
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the C++ CPU kernels could not be built here")
    backend = CpuBackend(ops, cpu_features())
    dtype, quantization, kv_dtype = PRECISIONS[precision]
    model = load_model(
        default_model_dir(),
        dtype=dtype,
        device=torch.device("cpu"),
        backend=backend,
        quantization=quantization,
    )
    rng = random.Random(0)

    def started() -> EngineCore:
        """A fresh pool and engine with every prompt added, none run."""
        pages = sequences * (-(-(context + STEPS + 2) // 16)) + 1
        kv = LocalKVCache(model.spec.pool_shape(kv_dtype, 16), pages)
        config = EngineConfig(max_batched_tokens=sequences * context, max_num_seqs=sequences)
        engine = EngineCore(model, kv, config)
        options = SamplingOptions(max_tokens=STEPS + 2, temperature=0.0, ignore_eos=True)
        for key in range(sequences):
            prompt = tuple(rng.randrange(100, 40000) for _ in range(context))
            engine.add(engine.new_sequence(key, EngineRequest(prompt, options)))
        return engine

    engine = started()
    engine.step()  # every prompt in one prefill step, and its first token
    if prefill:
        engine, steps = started(), 1  # other prompts: nothing in a prefix cache
    else:
        engine.step()  # a first decode step, untimed
        steps = STEPS
    seconds: Counter[str] = Counter()
    with timed(backend, seconds):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step = time.perf_counter() - start
    return {"step": step / steps * 1e3} | {name: seconds[name] / steps * 1e3 for name in OPERATIONS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", default="1,12,32")
    parser.add_argument("--context", type=int, default=480)
    parser.add_argument("--precisions", default="bfloat16,int8-bfloat16")
    parser.add_argument("--prefill", action="store_true", help="time the prefill step, not decode steps")
    args = parser.parse_args()
    columns = " | ".join(f"{name} ms" for name in OPERATIONS)
    print(f"| precision | sequences | step ms | {columns} | rest ms |")
    print(f"|---|---|---|{'---|' * (len(OPERATIONS) + 1)}")
    for precision in args.precisions.split(","):
        for sequences in (int(n) for n in args.sequences.split(",")):
            ms = profile(precision, sequences, args.context, args.prefill)
            rest = ms["step"] - sum(ms[name] for name in OPERATIONS)
            cells = " | ".join(f"{ms[name]:.1f}" for name in OPERATIONS)
            print(f"| {precision} | {sequences} | {ms['step']:.1f} | {cells} | {rest:.1f} |", flush=True)


if __name__ == "__main__":
    main()
