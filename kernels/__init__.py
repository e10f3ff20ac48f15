"""Kernels for the compute worker, behind one backend interface.

`backend` defines what a model needs from its kernels: paged attention (prefill over a cached prefix plus a
new chunk, and decode), the KV write through a slot mapping, RMSNorm fused with the residual add, rotary
embedding and SiLU-and-mul. `torch_ref` implements it with plain torch on any device, the CPU included; it
is also the reference the CuPy kernels are tested against.
"""

from kernels.backend import AttentionMetadata, KernelBackend
from kernels.torch_ref import TorchBackend

__all__ = ["AttentionMetadata", "KernelBackend", "TorchBackend"]
