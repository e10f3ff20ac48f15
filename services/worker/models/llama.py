"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (QKV bias), SmolLM2 (tied embeddings), and Qwen3
(Q/K norm per head): the shared decoder as it is."""

from __future__ import annotations

from services.worker.models.decoder import CausalLM


class Llama(CausalLM):
    model_types = ("llama", "mistral", "qwen2")


class Qwen3(CausalLM):
    model_types = ("qwen3",)
    qk_norm = True
