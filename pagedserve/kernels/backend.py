"""The kernel backend interface, and the attention metadata one engine step hands to it.

Shapes use these names: T tokens in the step, S sequences, Hq query heads, Hkv KV heads, D head dim,
P pages in the pool, B tokens a page, I the MLP's intermediate size, E experts.

One layer's KV cache is `kv_layer`, a view of the pool of shape [2, P, B, Hkv, D]: K at index 0, V at 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's new tokens sit in the step's flat batch, and where its KV lives in the pool.

    Sequences 0..num_decodes-1 are decodes with one new token each; the rest are prefill chunks, each
    attending causally to its cached prefix and to itself.
    """

    slot_mapping: torch.Tensor  # [T] int64: page * B + offset, where each new token's K and V go
    block_tables: torch.Tensor  # [S, max_pages] int64: each sequence's pages, padded with the null page 0
    seq_lens: torch.Tensor  # [S] int64: tokens in the cache after this step, new ones included
    query_start: torch.Tensor  # [S + 1] int64: sequence s's new tokens are q[query_start[s]:query_start[s+1]]
    num_decodes: int
    # Host copies of the two above, so that the torch path never waits on the device to read them.
    seq_lens_host: tuple[int, ...]
    query_start_host: tuple[int, ...]
    # For kernels that give each prefill token its own thread of work: its sequence's row in block_tables
    # and its position, [T - num_decodes] int64 each.
    prefill_seq: torch.Tensor
    prefill_pos: torch.Tensor
    # An upper bound of the decodes' seq_lens: CUDA graphs fix it at the context length.
    decode_max_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes: softmax(q k^T scale) v, with these variations."""

    scale: float
    window: int = (
        0  # > 0: each query sees its own token and the window - 1 before it (a sliding-window layer)
    )
    softcap: float = 0.0  # > 0: scores become softcap * tanh(scores / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None  # [Hq]: a logit per query head in its softmax's denominator (gpt-oss)

    @property
    def plain(self) -> bool:
        return self.window == 0 and self.softcap == 0 and self.sinks is None


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight in 8 bits a value: data * scale[:, None], one scale an output row (a weight
    quantized per channel, or one whose single per-tensor scale is repeated over its rows)."""

    data: torch.Tensor  # [N, K] int8 or float8_e4m3fn
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight it stands for, [N, K]: exact in float32."""
        return (self.data.float() * self.scale[:, None]).to(dtype)


@dataclass(frozen=True)
class PackedWeight:
    """A linear layer's weight [N, K] in the layout one backend's kernel reads (the CPU backend's, for
    broadcast products in float32, vdpbf16ps or vpdpbusd: pagedserve/kernels/cpu_backend.py), made at load by
    that backend's prepare_linear. unpacked() gives it back as it was, for any other backend."""

    # [ceil(N / group), K / step, group, step]: float32 (group: packed_float_group()), or bfloat16 or int8
    # with a scale (group 32)
    data: torch.Tensor
    scale: torch.Tensor | None  # [N] float32, for int8 data
    rows: int  # N
    sums: torch.Tensor | None = None  # [32 ceil(N / 32)] int32: 128 * each row's sum, for int8 in fours

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.data.shape[1] * self.data.shape[3]))

    def unpacked(self) -> torch.Tensor | QuantizedWeight:
        groups, steps, group, step = self.data.shape
        plain = self.data.permute(0, 2, 1, 3).reshape(groups * group, steps * step)[: self.rows].contiguous()
        return plain if self.scale is None else QuantizedWeight(plain, self.scale)


Weight = (
    torch.Tensor | QuantizedWeight | PackedWeight
)  # a linear layer's weight, as the backends' linear takes it


def plain_weight(weight: Weight) -> torch.Tensor | QuantizedWeight:
    """weight as [N, K] rows: a packed weight unpacked (a copy), any other as it is."""
    return weight.unpacked() if isinstance(weight, PackedWeight) else weight


@dataclass
class ExpertWeights:
    """A mixture of E experts: the router and each expert's gated MLP (biases where the model has them)."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2 I, H]: each expert's gate rows, then its up rows
    down: torch.Tensor  # [E, H, I]
    router_bias: torch.Tensor | None = None  # [E]
    gate_up_bias: torch.Tensor | None = None  # [E, 2 I]
    down_bias: torch.Tensor | None = None  # [E, H]


@dataclass(frozen=True)
class Routing:
    """How a mixture of experts picks and weighs a token's experts, and gates their MLPs."""

    top_k: int
    # Mixtral, Qwen3-MoE: softmax over every expert, the top k kept, rescaled to sum to one if renormalize.
    # gpt-oss (softmax_of_top): the top k router logits, and a softmax over those alone.
    renormalize: bool = False
    softmax_of_top: bool = False
    # 0: silu(gate) * up. > 0 (gpt-oss): gate clamped above and up on both sides at the limit, then
    # gate * sigmoid(alpha * gate) * (up + 1).
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702


class KernelBackend(Protocol):
    name: str

    def write_kv(
        self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store k, v [T, Hkv, D] into kv_layer [2, P, B, Hkv, D] at slot_mapping [T]."""

    def paged_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, layer: LayerAttention
    ) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over each sequence's cached KV, as `layer` says; returns
        [T, Hq, D].

        The KV of this step's tokens must already be written. Hq is a multiple of Hkv (GQA). With a window,
        the pages wholly before it are not read (they may be gone back to the pool).
        """

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over the last dim of x ([T, H], or [T, heads, D] for per-head norms), after adding
        residual (shaped like x) when given.

        Returns (normed, the new residual): the sum x + residual, which may be written into residual, or x
        itself when residual is None.
        """

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] by position (half-split, "neox" style); may work in place.

        cos_sin [max_positions, 2, D] holds cos and sin of every position, repeated over both halves.
        """

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * I] holds gate then up; returns silu(gate) * up, [T, I]."""

    def prepare_linear(self, weight: Weight, dtype: torch.dtype) -> Weight:
        """A linear layer's weight as this backend reads it fastest, against activations of dtype: at load,
        once (the weight itself, or a PackedWeight)."""

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] W^T [K, N] (+ bias [N]): F.linear. A quantized weight's product is taken in float32
        (x widened, the weight dequantized) and rounded to x's dtype once."""

    def gated_linear(
        self, x: torch.Tensor, gate_up: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """silu_and_mul(linear(x, gate_up, bias)): a gated MLP's first half, gate_up [2 I, K] holding gate's
        rows then up's; [T, I]. A backend may run it as one kernel that never stores the [T, 2 I] product."""

    def moe(self, x: torch.Tensor, experts: ExpertWeights, routing: Routing) -> torch.Tensor:
        """A mixture of experts over x [T, H]: each token goes to its top experts as routing says, and gets
        the weighted sum of their gated MLPs' outputs. Returns [T, H]."""
