"""The worker's own model code, run on the paged pool through a kernel backend.

`spec` reads a Hugging Face config into the few numbers every family needs; `weights` loads safetensors
into fused matrices (QKV, gate-up, stacked experts); `decoder` is the shared forward pass, which each
family module (`llama`, `phi3`, `olmo2`, `granite`, `gemma`, `mixtral`, `qwen3_moe`, `gpt_oss`) overrides
where it differs; `registry` picks the family from the config.
"""

from services.worker.models.decoder import CausalLM
from services.worker.models.registry import SUPPORTED, ModelRefused, load_model
from services.worker.models.spec import ModelSpec

__all__ = ["SUPPORTED", "CausalLM", "ModelRefused", "ModelSpec", "load_model"]
