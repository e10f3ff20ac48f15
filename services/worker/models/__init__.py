"""The worker's own model code for the Llama family, run on the paged pool through a kernel backend.

`spec` reads a Hugging Face config into the few numbers the model needs; `weights` loads safetensors into
fused matrices (QKV, gate-up); `llama` is the forward pass, which covers Llama 2/3, Mistral, Qwen2/2.5 (QKV
bias), Qwen3 (Q/K norm) and SmolLM2 (tied embeddings).
"""

from services.worker.models.llama import CausalLM
from services.worker.models.spec import ModelSpec

__all__ = ["CausalLM", "ModelSpec"]
