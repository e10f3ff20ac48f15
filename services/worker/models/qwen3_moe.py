"""Qwen3-MoE: Qwen3's decoder (Q/K norm per head) with a mixture of experts in the layers that
`decoder_sparse_step` picks and `mlp_only_layers` leaves out (those keep a dense MLP); the chosen experts'
weights are renormalized only with `norm_topk_prob`."""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedserve.kernels.backend import KernelBackend, Routing
from services.worker.models.decoder import CausalLM
from services.worker.models.spec import ModelSpec
from services.worker.models.weights import Weights


def sparse_layers(config: PretrainedConfig) -> list[int]:
    """The layers with experts, as transformers picks them."""
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers
        and config.num_experts > 0
        and (i + 1) % config.decoder_sparse_step == 0
    ]


class Qwen3Moe(CausalLM):
    model_types = ("qwen3_moe",)
    qk_norm = True

    def __init__(self, spec: ModelSpec, weights: Weights, backend: KernelBackend) -> None:
        expected = sparse_layers(spec.hf_config)
        found = [i for i, layer in enumerate(weights.layers) if layer.experts is not None]
        if found != expected:
            raise ValueError(f"the checkpoint has experts in layers {found}, its config in layers {expected}")
        super().__init__(spec, weights, backend)

    @property
    def routing(self) -> Routing:
        config = self.spec.hf_config
        return Routing(config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))
