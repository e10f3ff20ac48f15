"""Small random Hugging Face models of every family the worker runs, saved as real model folders.

Random weights make near-ties in the logits, where a rounding difference flips the argmax. The weights here
are drawn wider than transformers' initializer and every norm and bias is randomized (transformers starts
them at one and zero), so that parity tests exercise each tensor and compare real decisions.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 512
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

FAMILIES: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_COMMON, tie_word_embeddings=False),
    "llama3-rope": LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "smollm2-tied": LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "mistral": MistralConfig(**_COMMON, sliding_window=None),
    "qwen2-bias": Qwen2Config(**_COMMON, tie_word_embeddings=False),
    "qwen3-qknorm": Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False),
}


def make_model(family: str, folder: Path, seed: int = 0) -> Path:
    """Save a random model of the family into folder (config.json and model.safetensors)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    return folder
