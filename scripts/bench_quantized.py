"""int8 linear layers on this CPU, at SmolLM2-135M's layer shapes, against float32 and bfloat16.

    python scripts/bench_quantized.py [--rows 1,4,16,64,256,1024]

- `int8, bfloat16 x`: what `--quantization int8` runs on a bfloat16 model where this CPU runs vdpbf16ps and
  vpdpbusd (pagedserve/kernels/cpu_backend.py): W8A8 in packed_linear.cpp, each activation row rounded to
  int8 with its own scale and the products summed in int32 by vpdpbusd, or past AMX_INT8_SKINNY_ROWS rows
  by AMX's tiles where they run; `vpdpbusd only` is the same kernel kept off the tiles;
- `int8, float32 x`: what it runs on a float32 model: where vpdpbusd runs, the same W8A8 kernel with float32
  x in and out (no bfloat16 instruction: so also on a CPU with VNNI and no AVX512-BF16); elsewhere as
  `int8 weight-only`;
- `int8 weight-only`: float32 x times the int8 weight widened to float32 in registers by skinny_linear up to
  QUANTIZED_SKINNY_ROWS rows, and dequantized for MKL above (what int8 runs where vpdpbusd does not);
- `torch._int_mm W8A8`: the same W8A8 arithmetic through torch (oneDNN where the CPU has VNNI or AMX-INT8),
  the activations rounded by torch ops first, for comparison;
- float32 and bfloat16 weights through the same backend (packed_linear for bfloat16 where this CPU runs
  vdpbf16ps; else skinny_linear up to 16 rows, MKL or oneDNN above).

Each weight is taken as the worker loads it (CpuBackend.prepare_linear); the `bfloat16 [N, K]` and `int8
weight-only` columns keep the plain layout, to show what packing gains.

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

from pagedserve.kernels.backend import PackedWeight, QuantizedWeight  # noqa: E402
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops  # noqa: E402
from pagedserve.kernels.cpu_features import cpu_features  # noqa: E402
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


def vpdpbusd(ops: object, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """packed_linear's int8 x int8 product off AMX's tiles, at any number of rows."""
    return ops.packed_linear(x, weight.data, weight.scale, weight.sums, None, weight.rows, False, False)  # type: ignore[attr-defined]


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
        "int8 weight-only": (quantized, torch.float32),
        "bfloat16 [N, K]": (halves, torch.bfloat16),
        "bfloat16": (halves, torch.bfloat16),
        "int8, bfloat16 x": (quantized, torch.bfloat16),
    }
    for name, (ws, dtype) in columns.items():  # as the worker loads them, but the [N, K] columns
        if name not in ("bfloat16 [N, K]", "int8 weight-only"):
            columns[name] = ([backend.prepare_linear(w, dtype) for w in ws], dtype)
    packed = [w for w in columns["int8, bfloat16 x"][0] if isinstance(w, PackedWeight)]
    names = [*columns, *(["vpdpbusd only"] if packed else []), "torch._int_mm W8A8"]
    print(f"| rows | {' | '.join(f'{name} ms' for name in names)} |")
    print(f"|---|{'---|' * len(names)}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=generator) for k in (576, 1536)}
        times = []
        for ws, dtype in columns.values():
            x = {k: v.to(dtype) for k, v in inputs.items()}
            times.append(seconds(lambda ws=ws, x=x: [backend.linear(x[w.shape[1]], w) for w in ws]))
        if packed:  # where this CPU runs vpdpbusd
            halved = {k: v.bfloat16() for k, v in inputs.items()}
            times.append(seconds(lambda x=halved: [vpdpbusd(ops, x[w.shape[1]], w) for w in packed]))
        times.append(seconds(lambda inputs=inputs: [w8a8(inputs[q.shape[1]], q) for q in quantized]))
        print(f"| {rows} | {' | '.join(f'{t * 1e3:.1f}' for t in times)} |", flush=True)


if __name__ == "__main__":
    main()
