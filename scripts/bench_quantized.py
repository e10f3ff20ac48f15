"""int8 linear layers two ways on this CPU, at SmolLM2-135M's layer shapes, against float32.

    python scripts/bench_quantized.py [--rows 1,4,16,64,256,1024]

- weight-only: int8 weights with a scale a row, activations in float32 or bfloat16: what `--quantization
  int8` runs (kernels/cpu_backend.py: skinny_linear, which widens the weight in registers, to bfloat16 for
  vdpbf16ps where this CPU runs it, up to QUANTIZED_SKINNY_ROWS rows; the weight dequantized for MKL above);
- W8A8: activations quantized too, per token with a dynamic scale, and an int8 GEMM with int32 sums
  (torch._int_mm, through oneDNN where the CPU has VNNI or AMX-INT8), rescaled by both scales;
- float32 and bfloat16 weights through the same backend (skinny_linear up to 16 rows, MKL or oneDNN above).

The weights are separate for each of 30 layers (424 MB in float32), so they stream from memory as in a
decode step. Each cell is the time of one pass over all 120 GEMMs; compare within one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import QuantizedWeight  # noqa: E402
from kernels.cpu_backend import CpuBackend, cpu_ops  # noqa: E402
from kernels.cpu_features import cpu_features  # noqa: E402
from services.worker.models.quantized import quantize_int8  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # QKV, O, gate-up, down: [N, K]


def seconds(run: Callable[[], object], repeats: int = 5) -> float:
    run()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def w8a8(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x W^T with x quantized per token: int8 x int8 into int32, then both scales."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    xq = torch.round(x / scale).to(torch.int8)
    if xq.shape[0] <= 16:  # torch._int_mm takes more than 16 rows
        xq = torch.cat((xq, xq.new_zeros(17 - xq.shape[0], xq.shape[1])))
    sums = torch._int_mm(xq, weight.data.t())[: x.shape[0]]
    return sums.float() * scale * weight.scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    args = parser.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the C++ CPU kernels could not be built here")
    backend = CpuBackend(ops, cpu_features())
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) for _ in range(30) for n, k in LAYER_SHAPES]
    halves = [w.bfloat16() for w in weights]
    quantized = [quantize_int8(w) for w in weights]
    columns = {
        "float32": (weights, torch.float32),
        "int8, float32 x": (quantized, torch.float32),
        "bfloat16": (halves, torch.bfloat16),
        "int8, bfloat16 x": (quantized, torch.bfloat16),
    }
    print(f"| rows | {' | '.join(f'{name} ms' for name in columns)} | W8A8 ms |")
    print(f"|---|{'---|' * (len(columns) + 1)}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=generator) for k in (576, 1536)}
        times = []
        for ws, dtype in columns.values():
            x = {k: v.to(dtype) for k, v in inputs.items()}
            times.append(seconds(lambda ws=ws, x=x: [backend.linear(x[w.shape[1]], w) for w in ws]))
        both = seconds(lambda inputs=inputs: [w8a8(inputs[q.shape[1]], q) for q in quantized])
        print(f"| {rows} | {' | '.join(f'{t * 1e3:.1f}' for t in times)} | {both * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
