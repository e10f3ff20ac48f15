"""Gemma 2 and Gemma 3 (text): the embedding scaled by sqrt(H), norms of x * (1 + w), a norm before and
after both attention and the MLP, a GELU (tanh) gate, attention scaled by query_pre_attn_scalar, and
sliding-window layers between full ones. Gemma 2 softcaps the attention scores and the logits; Gemma 3
normalizes each query and key head and gives its sliding and full layers rotary parameters of their own."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.backend import KernelBackend, LayerAttention
from services.worker.models.decoder import CausalLM, Layer, Step
from services.worker.models.spec import ModelSpec
from services.worker.models.weights import LayerWeights, Weights


class Gemma2(CausalLM):
    model_types = ("gemma2",)

    def __init__(self, spec: ModelSpec, weights: Weights, backend: KernelBackend) -> None:
        _shift_norms(weights)
        super().__init__(spec, weights, backend)
        self.embed_scale = torch.tensor(spec.hidden_size**0.5, dtype=self.dtype)

    def layer_attention(self, i: int) -> LayerAttention:
        config = self.spec.hf_config
        return LayerAttention(
            config.query_pre_attn_scalar**-0.5,
            window=self.spec.windows[i],
            softcap=getattr(config, "attn_logit_softcapping", None) or 0.0,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def block(
        self, layer: Layer, hidden: torch.Tensor, residual: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stream is hidden alone (residual stays None): each branch is normed before and after."""
        be, eps, w = self.backend, self.spec.rms_norm_eps, layer.weights
        attn = self.attention(layer, be.rms_norm(hidden, w.input_norm, eps)[0], step)  # type: ignore[arg-type]
        hidden = hidden + be.rms_norm(attn, w.post_norm, eps)[0]
        mlp = self.mlp(layer, be.rms_norm(hidden, w.pre_mlp_norm, eps)[0])  # type: ignore[arg-type]
        return hidden + be.rms_norm(mlp, w.post_mlp_norm, eps)[0], None  # type: ignore[arg-type]

    def gated(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        gate, up = self.backend.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # type: ignore[arg-type]
        return F.gelu(gate, approximate="tanh") * up

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().logits(x)
        cap = getattr(self.spec.hf_config, "final_logit_softcapping", None)
        return cap * torch.tanh(logits / cap) if cap else logits


class Gemma3(Gemma2):
    model_types = ("gemma3_text",)
    qk_norm = True

    def layer_type(self, i: int) -> str:
        return self.spec.hf_config.layer_types[i]


def _shift_norms(weights: Weights) -> None:
    """Gemma's norms scale by 1 + w: add the one once, at load (in fp32, as transformers computes it)."""
    weights.norm = _plus_one(weights.norm)
    for layer in weights.layers:
        for name in ("input_norm", "post_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm"):
            norm = getattr(layer, name)
            if norm is not None:
                setattr(layer, name, _plus_one(norm))


def _plus_one(weight: torch.Tensor) -> torch.Tensor:
    return (weight.float() + 1.0).to(weight.dtype)
