"""IBM Granite 3: Llama's decoder with four multipliers: on the embedding, on each block's two residual
branches, as the attention's scale, and a divisor of the logits."""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.kernels.backend import LayerAttention
from services.worker.models.decoder import CausalLM, Layer, Step


class Granite(CausalLM):
    model_types = ("granite",)

    def layer_attention(self, i: int) -> LayerAttention:
        return replace(super().layer_attention(i), scale=self.spec.hf_config.attention_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.spec.hf_config.embedding_multiplier

    def attention(self, layer: Layer, x: torch.Tensor, step: Step) -> torch.Tensor:
        return super().attention(layer, x, step) * self.spec.hf_config.residual_multiplier

    def mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        return super().mlp(layer, x) * self.spec.hf_config.residual_multiplier

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return super().logits(x) / self.spec.hf_config.logits_scaling
