"""The Llama-family forward pass over a flat batch of tokens and the paged KV pool."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.backend import AttentionMetadata, KernelBackend
from services.worker.models.spec import ModelSpec
from services.worker.models.weights import Weights, load_weights


def rotary_table(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin of every position, [max_model_len, 2, D], computed as transformers computes them."""
    config = spec.hf_config
    # transformers 5 calls it rope_parameters; 4.x had rope_scaling beside rope_theta.
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float) / spec.head_dim))
        scaling = 1.0
    elif rope_type in ("linear", "llama3", "yarn"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3 and yarn are)")
    positions = torch.arange(spec.max_model_len, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    table = torch.stack((angles.cos() * scaling, angles.sin() * scaling), dim=1)
    return table.to(device=device, dtype=dtype)


class CausalLM:
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
    def from_pretrained(
        cls, model_dir: Path, *, dtype: torch.dtype, device: torch.device, backend: KernelBackend
    ) -> CausalLM:
        spec = ModelSpec.from_pretrained(model_dir)
        return cls(spec, load_weights(model_dir, spec, dtype, device), backend)

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
        spec, be, w = self.spec, self.backend, self.weights
        tokens = input_ids.shape[0]
        eps = spec.rms_norm_eps
        hidden = F.embedding(input_ids, w.embed)
        residual = None
        for i, layer in enumerate(w.layers):
            x, residual = be.rms_norm(hidden, layer.input_norm, eps, residual)
            q, k, v = be.linear(x, layer.qkv, layer.qkv_bias).split(self._split, dim=-1)
            q = q.view(tokens, spec.num_heads, spec.head_dim)
            k = k.view(tokens, spec.num_kv_heads, spec.head_dim)
            v = v.view(tokens, spec.num_kv_heads, spec.head_dim)
            if spec.qk_norm:
                q = be.rms_norm(q, layer.q_norm, eps)[0]  # type: ignore[arg-type]
                k = be.rms_norm(k, layer.k_norm, eps)[0]  # type: ignore[arg-type]
            q, k = be.rotary(q, k, positions, self.cos_sin)
            be.write_kv(kv[i], k, v, meta.slot_mapping)
            attn = be.paged_attention(q, kv[i], meta, self.scale)
            hidden = be.linear(attn.view(tokens, -1), layer.o, layer.o_bias)
            x, residual = be.rms_norm(hidden, layer.post_norm, eps, residual)
            gate_up = be.linear(x, layer.gate_up, layer.gate_up_bias)
            hidden = be.linear(be.silu_and_mul(gate_up), layer.down, layer.down_bias)
        # Only the rows that sample need the final norm and the vocabulary projection.
        assert residual is not None
        x, _ = be.rms_norm(hidden[logits_indices], w.norm, eps, residual[logits_indices])
        return be.linear(x, w.lm_head).float()
