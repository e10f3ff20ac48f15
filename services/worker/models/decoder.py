"""The shared decoder: a Llama-shaped transformer over a flat batch of tokens and the paged KV pool, whose
steps (the embedding, a block, its attention and MLP, the logits) a family overrides where it differs."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.backend import AttentionMetadata, KernelBackend
from services.worker.models.spec import ModelSpec
from services.worker.models.weights import LayerWeights, Weights

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rotary_table(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin of every position, [max_model_len, 2, D], computed as transformers computes them.

    Long RoPE (Phi-3) has a short and a long set of factors, and transformers picks the long one for a
    forward pass that reaches past original_max_position_embeddings. A paged cache keeps keys rotated once,
    so one set serves: the long one when the served context reaches past the original length (as vLLM
    does), which agrees with transformers for every sequence that does too.
    """
    config = spec.hf_config
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float) / spec.head_dim))
        scaling = 1.0
    elif rope_type == "longrope":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
            config, torch.device("cpu"), seq_len=spec.max_model_len
        )
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    positions = torch.arange(spec.max_model_len, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    table = torch.stack((angles.cos() * scaling, angles.sin() * scaling), dim=1)
    return table.to(device=device, dtype=dtype)


def rope_parameters(config: PretrainedConfig) -> dict:
    # transformers 5 calls it rope_parameters; 4.x had rope_scaling beside rope_theta.
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


class CausalLM:
    """A family's forward pass; this one is Llama's, which the families override where they differ."""

    model_types: ClassVar[tuple[str, ...]] = ()  # the config.json model_type values the family serves
    qk_norm: ClassVar[bool] = False  # the checkpoint must have q_norm and k_norm weights

    def __init__(self, spec: ModelSpec, weights: Weights, backend: KernelBackend) -> None:
        self.spec = spec
        self.weights = weights
        self.backend = backend
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.cos_sin = rotary_table(spec, self.device, self.dtype)
        self.scale = spec.head_dim**-0.5
        kv_width = spec.num_kv_heads * spec.head_dim
        self._split = [spec.num_heads * spec.head_dim, kv_width, kv_width]

    @classmethod
    def check(cls, config: PretrainedConfig) -> None:
        """Refuse, with ValueError, a config of the family that this code does not compute exactly."""
        rope = rope_parameters(config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("a partial_rotary_factor below 1 is not supported: rotary turns whole heads")

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step can run in a CUDA graph: none of its ops reads the device from the host."""
        return all(layer.experts is None for layer in self.weights.layers)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run T tokens through the model, writing their KV into kv, the pool [L, 2, P, B, Hkv, D].

        input_ids, positions: [T]. Returns fp32 logits [len(logits_indices), V] for the rows asked for.
        """
        hidden = self.embed(input_ids)
        residual = None
        for i, layer in enumerate(self.weights.layers):
            hidden, residual = self.block(layer, hidden, residual, positions, meta, kv[i])
        # Only the rows that sample need the final norm and the vocabulary projection.
        rest = None if residual is None else residual[logits_indices]
        x, _ = self.backend.rms_norm(hidden[logits_indices], self.weights.norm, self.spec.rms_norm_eps, rest)
        return self.logits(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weights.embed)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weights.lm_head).float()

    def block(
        self,
        layer: LayerWeights,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer, pre-norm: the residual stream is hidden + residual (hidden alone while residual is
        None), and the norms add the two as they normalize."""
        be, eps = self.backend, self.spec.rms_norm_eps
        x, residual = be.rms_norm(hidden, layer.input_norm, eps, residual)  # type: ignore[arg-type]
        hidden = self.attention(layer, x, positions, meta, kv_layer)
        x, residual = be.rms_norm(hidden, layer.post_norm, eps, residual)
        return self.mlp(layer, x), residual

    def attention(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
    ) -> torch.Tensor:
        spec, be = self.spec, self.backend
        tokens = x.shape[0]
        q, k, v = be.linear(x, layer.qkv, layer.qkv_bias).split(self._split, dim=-1)
        q = q.view(tokens, spec.num_heads, spec.head_dim)
        k = k.view(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(tokens, spec.num_kv_heads, spec.head_dim)
        if layer.q_norm is not None:
            q, k = self.norm_qk(layer, q, k)
        q, k = be.rotary(q, k, positions, self.cos_sin)
        be.write_kv(kv_layer, k, v, meta.slot_mapping)
        attn = be.paged_attention(q, kv_layer, meta, self.scale)
        return be.linear(attn.view(tokens, -1), layer.o, layer.o_bias)

    def norm_qk(
        self, layer: LayerWeights, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q/K norm, on q [T, Hq, D] and k [T, Hkv, D]: each head on its own (Qwen3)."""
        eps = self.spec.rms_norm_eps
        return self.backend.rms_norm(q, layer.q_norm, eps)[0], self.backend.rms_norm(k, layer.k_norm, eps)[0]  # type: ignore[arg-type]

    def mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        be = self.backend
        if layer.experts is not None:
            experts = layer.experts
            return be.moe(x, experts.router, experts.gate_up, experts.down, *self.routing)
        gate_up = be.linear(x, layer.gate_up, layer.gate_up_bias)  # type: ignore[arg-type]
        return be.linear(be.silu_and_mul(gate_up), layer.down, layer.down_bias)  # type: ignore[arg-type]

    @property
    def routing(self) -> tuple[int, bool]:
        """A mixture of experts' top_k, and whether the chosen experts' weights are rescaled to sum to one."""
        raise ValueError(f"{self.spec.model_type} has no mixture of experts")
