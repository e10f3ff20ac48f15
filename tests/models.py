"""Small random Hugging Face models of every family the worker runs, saved as real model folders with
tokenizers of their own.

Random weights make near-ties in the logits, where a rounding difference flips the argmax. The weights here
are drawn wider than transformers' initializer and every norm and bias is randomized (transformers starts
them at one and zero), so that parity tests exercise each tensor and compare real decisions.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
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
    "phi3-fused": Phi3Config(**_COMMON, tie_word_embeddings=False),
    # Phi-4-mini's partial rotary: 12 of each head's 16 dims turn.
    "phi3-partial": Phi3Config(**_COMMON, tie_word_embeddings=False, partial_rotary_factor=0.75),
    "olmo2-postnorm": Olmo2Config(**_COMMON, tie_word_embeddings=False),
    "granite-multipliers": GraniteConfig(
        **_COMMON,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
        tie_word_embeddings=False,
    ),
    # Windows shorter than most test prompts; softcaps low enough to bend the scores and the logits.
    "gemma2-softcap": Gemma2Config(
        **_COMMON,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0,
    ),
    "gemma3-local-global": Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3},
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
        },
    ),
    # Experts with biases and a clamp low enough to bite; sinks; a window of 24, then a full layer.
    "gpt-oss": GptOssConfig(
        **{**_COMMON, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=24,
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    ),
    "mistral-window": MistralConfig(**_COMMON, sliding_window=28),
    "mixtral-moe": MixtralConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False
    ),
    # Layer 0 has experts, layer 1 a dense MLP; the chosen experts' weights are not renormalized.
    "qwen3-moe": Qwen3MoeConfig(
        **_COMMON,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
}

# Configs outside the parity matrix, each with a test of its own: Long RoPE agrees with transformers only for
# sequences past its original context (decoder.rotary_table says why).
VARIANTS: dict[str, PretrainedConfig] = {
    "phi3-longrope": Phi3Config(
        **_COMMON,
        tie_word_embeddings=False,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 0.7 * i for i in range(8)],
        },
    ),
    # Phi-4-mini's rotary: Long RoPE over 12 of each head's 16 dims.
    "phi3-longrope-partial": Phi3Config(
        **_COMMON,
        tie_word_embeddings=False,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [1.0 + 0.7 * i for i in range(6)],
        },
    ),
}


def make_model(
    family: str, folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object
) -> Path:
    """Save a random model of the family, in dtype, and a tokenizer for it, into folder.

    overrides change the family's config (e.g. hidden_size, num_attention_heads for a head dim of 64).
    """
    torch.manual_seed(seed)
    base = {**FAMILIES, **VARIANTS}[family]
    config = base.__class__.from_dict({**base.to_dict(), **overrides})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.15)
    model.to(dtype).save_pretrained(folder)
    make_tokenizer(folder, config.vocab_size)
    return folder


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly vocab_size tokens (ids 0, 1, 2: pad, bos, eos), and a chat
    template, trained in a few milliseconds on a sentence or two."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([_CORPUS] * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.add_tokens(
        [f"<extra_{i}>" for i in range(vocab_size - len(fast))]
    )  # every id the model emits decodes
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! Paris is the capital of France. "
    "héllo 世界 🎉 naïve café. Once upon a time, in a land far away, there lived a curious cat."
)
