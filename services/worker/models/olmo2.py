"""OLMo 2: norms after attention and after the MLP rather than before them (each branch is normed and
then added to the stream), and Q/K norm over the whole projection rather than per head."""

from __future__ import annotations

import torch

from services.worker.models.decoder import CausalLM, Layer, Step
from services.worker.models.weights import LayerWeights


class Olmo2(CausalLM):
    model_types = ("olmo2",)
    qk_norm = True

    def block(
        self, layer: Layer, hidden: torch.Tensor, residual: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stream is hidden alone (residual stays None): x + norm(attention(x)), then likewise the MLP."""
        be, eps, w = self.backend, self.spec.rms_norm_eps, layer.weights
        hidden = hidden + be.rms_norm(self.attention(layer, hidden, step), w.post_norm, eps)[0]
        return hidden + be.rms_norm(self.mlp(layer, hidden), w.post_mlp_norm, eps)[0], None  # type: ignore[arg-type]

    def norm_qk(self, w: LayerWeights, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.spec.rms_norm_eps
        q_normed = self.backend.rms_norm(q.reshape(q.shape[0], -1), w.q_norm, eps)[0]  # type: ignore[arg-type]
        k_normed = self.backend.rms_norm(k.reshape(k.shape[0], -1), w.k_norm, eps)[0]  # type: ignore[arg-type]
        return q_normed.view(q.shape), k_normed.view(k.shape)
