"""The CUDA backend: the kernels in csrc/, through their typed wrappers, with launch parameters tuned for
the device's architecture. Every launch goes on torch's current stream."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cuda_experts, cuda_ops
from pagedserve.kernels.backend import (
    AttentionMetadata,
    ExpertWeights,
    LayerAttention,
    QuantizedWeight,
    Routing,
    Weight,
    plain_weight,
)
from pagedserve.kernels.torch_ref import quantized_linear
from pagedserve.kernels.tuning import tuning_for

EMULATED_ARCH = 90


class CupyBackend:
    name = "cupy"

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            self.tuning = tuning_for(major * 10 + minor)
        else:  # the kernels in the emulator (pagedserve/kernels/emulator.py), launched as on a Hopper
            self.tuning = tuning_for(EMULATED_ARCH)

    def write_kv(
        self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        cuda_ops.kv_write(kv_layer, k, v, slot_mapping, self.tuning)

    def paged_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, layer: LayerAttention
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = meta.num_decodes
        if n:
            tables, lens = meta.block_tables[:n], meta.seq_lens[:n]
            cuda_ops.paged_decode(
                out[:n], q[:n], kv_layer, tables, lens, meta.decode_max_len, layer, self.tuning
            )
        if n < q.shape[0]:
            cuda_ops.paged_prefill(out[n:], q[n:], kv_layer, meta, layer, self.tuning)
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cuda_ops.rms_norm(x, weight, eps, residual, self.tuning)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cuda_ops.rotary(q, k, positions, cos_sin, self.tuning)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_ops.silu_and_mul(x, self.tuning)

    def prepare_linear(self, weight: Weight, dtype: torch.dtype) -> Weight:
        return weight

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = plain_weight(weight)
        if isinstance(weight, QuantizedWeight):  # dequantized each call: correct, not fast
            return quantized_linear(x, weight, bias)
        return F.linear(x, weight, bias)  # cuBLAS

    def gated_linear(
        self, x: torch.Tensor, gate_up: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.silu_and_mul(self.linear(x, gate_up, bias))

    def moe(self, x: torch.Tensor, experts: ExpertWeights, routing: Routing) -> torch.Tensor:
        return cuda_experts.moe(x, experts, routing, self.tuning)  # grouped GEMMs, with no host sync
