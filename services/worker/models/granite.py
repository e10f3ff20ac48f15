"""IBM Granite 3: Llama's decoder with four multipliers: on the embedding, on each block's two residual
branches, as the attention's scale, and a divisor of the logits."""

from __future__ import annotations

import torch

from kernels.backend import AttentionMetadata, KernelBackend
from services.worker.models.decoder import CausalLM
from services.worker.models.spec import ModelSpec
from services.worker.models.weights import LayerWeights, Weights


class Granite(CausalLM):
    model_types = ("granite",)

    def __init__(self, spec: ModelSpec, weights: Weights, backend: KernelBackend) -> None:
        super().__init__(spec, weights, backend)
        config = spec.hf_config
        self.scale = config.attention_multiplier
        self.embedding_multiplier = config.embedding_multiplier
        self.residual_multiplier = config.residual_multiplier
        self.logits_scaling = config.logits_scaling

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def attention(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
    ) -> torch.Tensor:
        return super().attention(layer, x, positions, meta, kv_layer) * self.residual_multiplier

    def mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return super().mlp(layer, x) * self.residual_multiplier

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return super().logits(x) / self.logits_scaling
