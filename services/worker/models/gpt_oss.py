"""gpt-oss: a mixture of experts in every layer, routed by a softmax over each token's top router logits,
with biases throughout and the experts' clamped SwiGLU; attention with a learned sink per head (which
`weights` loads and the shared decoder passes on) and sliding-window layers between full ones."""

from __future__ import annotations

from pagedserve.kernels.backend import Routing
from services.worker.models.decoder import CausalLM


class GptOss(CausalLM):
    model_types = ("gpt_oss",)

    @property
    def routing(self) -> Routing:
        config = self.spec.hf_config
        return Routing(
            config.num_experts_per_tok,
            softmax_of_top=True,
            swiglu_limit=config.swiglu_limit,
            swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
        )
