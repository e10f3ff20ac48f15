"""Which of this CPU's bfloat16 instructions a process can actually run, tested, not read off its flags.

A CPU's flags (and the cpuinfo library torch reads them through) say what the silicon has. Whether a
process may run it is another matter: AMX's tiles need the kernel's leave (arch_prctl), and a hypervisor may
advertise what it does not pass through; these machines advertise AMX, and llama.cpp built with its AMX
paths dies of SIGILL on them. So each feature that is advertised is run once, on known inputs, in a child
process (`probe_feature` in pagedserve/kernels/cpu/features.cpp): a SIGILL, a wrong answer or a hang there
costs the child, and the worker goes on without the feature, saying why. Where the instruction runs but
pagedserve's own GEMM on it answers wrongly, the feature is left off too, and the worker logs it as the
defect it is (`Feature.our_defect`, which the tests assert is never so).

- `avx512_bf16` (vdpbf16ps): the few-row GEMM's bfloat16 dot products. Its probe also runs that GEMM both
  ways on random inputs, so that a path this machine cannot check otherwise is checked where it runs.
- `avx512_vnni` (vpdpbusd): int8 weights times activations quantized to int8 per row (W8A8), for float32
  activations, and for bfloat16 ones with `avx512_bf16`. Its probe also runs the float32 form of that GEMM
  on random inputs against the same rounding in torch: on a CPU with VNNI and no AVX512-BF16 (Cascade
  Lake, Ice Lake) nothing else checks it.
- `amx_bf16`: oneDNN's bfloat16 GEMMs (torch's F.linear), which use the tiles where it finds them, and the
  prefill attention's products (paged_prefill.cpp).
- `amx_int8`: with `avx512_vnni`, the int8 GEMM of a prefill's many rows (packed_linear.cpp).

Either makes bfloat16 this CPU's best dtype (`best_dtype`); without both, float32 is faster, since a
bfloat16 GEMM is then widened to float32 anyway.
"""

from __future__ import annotations

import functools
import logging
import signal
import subprocess
import sys
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FEATURES = ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
# The probe's exit status when the instruction ran right but pagedserve's own GEMM on it did not: a defect
# of ours, which the fallback would otherwise hide (every test would then take the path left).
OUR_GEMM_WRONG = 3
PROBE_TIMEOUT_S = (
    120  # a child that imports torch and loads the ops; a hung instruction must not hang a start
)


@dataclass(frozen=True)
class Feature:
    name: str
    usable: bool
    why: str  # what the probe found, for the log
    our_defect: bool = False  # refused because pagedserve's GEMM on it gave wrong answers, not the CPU


@dataclass(frozen=True)
class CpuFeatures:
    avx512_bf16: Feature
    avx512_vnni: Feature
    amx_bf16: Feature
    amx_int8: Feature

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 GEMMs run in hardware here (dot products or tiles)."""
        return self.avx512_bf16.usable or self.amx_bf16.usable

    def best_dtype(self) -> tuple[torch.dtype, str]:
        """bfloat16 where the CPU runs it in hardware, else float32; and why, for the log."""
        found = "; ".join(feature.why for feature in (self.avx512_bf16, self.amx_bf16))
        if self.native_bf16:
            return torch.bfloat16, f"bfloat16, which this CPU runs in hardware ({found})"
        return torch.float32, f"float32: this CPU has no bfloat16 arithmetic that runs here ({found})"


def advertised() -> set[str]:
    """The features of FEATURES that the CPU's flags (through torch's cpuinfo) claim."""
    capabilities = torch.cpu.get_capabilities()
    return {name for name in FEATURES if capabilities.get(name)}


@functools.cache
def cpu_features() -> CpuFeatures:
    """Each feature advertised, probed in a child process; one that is not advertised is not probed."""
    claimed = advertised()
    found = {
        name: probe(name) if name in claimed else Feature(name, False, f"no {name}") for name in FEATURES
    }
    return CpuFeatures(**found)


def probe(name: str) -> Feature:
    """Runs the feature in a child: usable only if the child ran it and got the known answers."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pagedserve.kernels.cpu_features", name],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return Feature(name, False, f"{name} is advertised, but its probe hung for {PROBE_TIMEOUT_S} s")
    if done.returncode == 0:
        return Feature(name, True, f"{name} ran")
    if done.returncode == -signal.SIGILL:
        return Feature(name, False, f"{name} is advertised, but running it raised SIGILL")
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    if done.returncode == OUR_GEMM_WRONG:
        log.error("%s runs, but pagedserve's GEMM on it gave wrong answers: %s", name, last)
        return Feature(
            name, False, f"{name} runs, but pagedserve's GEMM on it gave wrong answers ({last})", True
        )
    return Feature(
        name, False, f"{name} is advertised, but its probe failed (exit {done.returncode}: {last})"
    )


def _check_dot_bf16(ops: object) -> None:
    """The packed GEMM (vdpbf16ps) against the few-row GEMM widened to float32, on random inputs."""
    from pagedserve.kernels.cpu_backend import pack_linear

    generator = torch.Generator().manual_seed(0)
    for rows, k, n in ((1, 576, 64), (5, 1000, 33), (16, 64, 8)):
        x = torch.randn(rows, k, generator=generator).bfloat16()
        w = torch.randn(n, k, generator=generator).bfloat16()
        bias = torch.randn(n, generator=generator).bfloat16()
        packed = pack_linear(w)
        dot = ops.packed_linear(x, packed.data, None, None, bias, n, False, False)  # type: ignore[attr-defined]
        widened = ops.skinny_linear(x, w, None, bias)  # type: ignore[attr-defined]
        torch.testing.assert_close(dot.float(), widened.float(), rtol=2e-2, atol=2e-2 * k**0.5)


def _check_dot_int8(ops: object) -> None:
    """The packed int8 GEMM (vpdpbusd) on float32 rows against the same W8A8 rounding in torch, on random
    inputs."""
    from pagedserve.kernels.backend import QuantizedWeight
    from pagedserve.kernels.cpu_backend import pack_linear

    generator = torch.Generator().manual_seed(0)
    for rows, k, n in ((1, 576, 64), (5, 1000, 33), (20, 64, 8)):
        x = torch.randn(rows, k, generator=generator)
        data = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
        scale = torch.rand(n, generator=generator) / 127
        bias = torch.randn(n, generator=generator)
        packed = pack_linear(QuantizedWeight(data, scale))
        args = (packed.data, packed.scale, packed.sums, bias, n, False, False)
        dot = ops.packed_linear(x, *args)  # type: ignore[attr-defined]
        # The kernel's float32 operations (a division, then a product by 1 / 127), so that ties round alike.
        top = x.abs().amax(dim=1, keepdim=True)
        inverse = torch.full_like(top, 127) / top
        rounded = torch.round(x * inverse) * (top * torch.tensor(1 / 127, dtype=torch.float32))
        expected = rounded @ (data.float() * scale[:, None]).T + bias
        torch.testing.assert_close(dot, expected, rtol=1e-4, atol=1e-4 * k**0.5)


def main(name: str) -> int:
    """The child's side: 0 when the feature gives the right answers, 1 when not, OUR_GEMM_WRONG when only
    pagedserve's GEMM on it does not; SIGILL kills it first."""
    from pagedserve.kernels.cpu_backend import cpu_ops

    ops = cpu_ops()
    if ops is None:
        print("the C++ CPU kernels are not built, so nothing can run the probe", file=sys.stderr)
        return 1
    try:
        right = ops.probe_feature(name)
    except RuntimeError as exc:  # refused before it ran
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 1
    if not right:
        print(f"{name} ran, but gave a wrong answer", file=sys.stderr)
        return 1
    checks = {"avx512_bf16": _check_dot_bf16, "avx512_vnni": _check_dot_int8}
    try:
        if name in checks:
            checks[name](ops)
    except AssertionError as exc:
        print(str(exc).strip().splitlines()[0], file=sys.stderr)
        return OUR_GEMM_WRONG
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main(sys.argv[1]))
