"""Mixtral: Mistral's decoder with a mixture of experts for every MLP: each token goes to the top
`num_experts_per_tok` of `num_local_experts`, their weights renormalized to sum to one."""

from __future__ import annotations

from pagedserve.kernels.backend import Routing
from services.worker.models.decoder import CausalLM


class Mixtral(CausalLM):
    model_types = ("mixtral",)

    @property
    def routing(self) -> Routing:
        return Routing(self.spec.hf_config.num_experts_per_tok, renormalize=True)
