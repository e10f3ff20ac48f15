"""int8 linear layers two ways on this CPU, at SmolLM2-135M's layer shapes, against float32.

    python scripts/bench_quantized.py [--rows 1,4,16,64,256,1024]

- weight-only: int8 weights with a scale a row, activations in float32: what `--quantization int8` runs
  (kernels/cpu_backend.py: skinny_linear, which widens the weight in registers, up to QUANTIZED_SKINNY_ROWS
  rows; the weight dequantized for MKL above that);
- W8A8: activations quantized too, per token with a dynamic scale, and an int8 GEMM with int32 sums
  (torch._int_mm, through oneDNN where the CPU has VNNI or AMX-INT8), rescaled by both scales;
- float32 weights through the same backend (skinny_linear up to 16 rows, MKL above).

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
    backend = CpuBackend(ops)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) for _ in range(30) for n, k in LAYER_SHAPES]
    quantized = [quantize_int8(w) for w in weights]
    print(
        "| rows | float32 ms | int8 weight-only ms | W8A8 ms | weight-only / float32 | W8A8 / weight-only |"
    )
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=generator) for k in (576, 1536)}
        fp32 = seconds(lambda inputs=inputs: [backend.linear(inputs[w.shape[1]], w) for w in weights])
        only = seconds(lambda inputs=inputs: [backend.linear(inputs[q.shape[1]], q) for q in quantized])
        both = seconds(lambda inputs=inputs: [w8a8(inputs[q.shape[1]], q) for q in quantized])
        print(
            f"| {rows} | {fp32 * 1e3:.1f} | {only * 1e3:.1f} | {both * 1e3:.1f} | {only / fp32:.2f} "
            f"| {both / only:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
