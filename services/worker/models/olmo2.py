"""OLMo 2: norms after attention and after the MLP rather than before them (each branch is normed and
then added to the stream), and Q/K norm over the whole projection rather than per head."""

from __future__ import annotations

import torch

from kernels.backend import AttentionMetadata
from services.worker.models.decoder import CausalLM
from services.worker.models.weights import LayerWeights


class Olmo2(CausalLM):
    model_types = ("olmo2",)
    qk_norm = True

    def block(
        self,
        layer: LayerWeights,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stream is hidden alone (residual stays None): x + norm(attention(x)), then likewise the MLP."""
        be, eps = self.backend, self.spec.rms_norm_eps
        attn = self.attention(layer, hidden, positions, meta, kv_layer)
        hidden = hidden + be.rms_norm(attn, layer.post_norm, eps)[0]
        mlp = self.mlp(layer, hidden)
        return hidden + be.rms_norm(mlp, layer.post_mlp_norm, eps)[0], None  # type: ignore[arg-type]

    def norm_qk(
        self, layer: LayerWeights, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.spec.rms_norm_eps
        q_normed = self.backend.rms_norm(q.reshape(q.shape[0], -1), layer.q_norm, eps)[0]  # type: ignore[arg-type]
        k_normed = self.backend.rms_norm(k.reshape(k.shape[0], -1), layer.k_norm, eps)[0]  # type: ignore[arg-type]
        return q_normed.view(q.shape), k_normed.view(k.shape)
