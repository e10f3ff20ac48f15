"""A model's architecture, read from its Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import GenerationConfig, PretrainedConfig

from memory_daemon.shape import DType, PoolShape
from services.worker.kv.groups import KVGroups, kv_groups


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool  # queries and keys are normalized before rotary (Qwen3, OLMo 2)
    rotary_dim: int  # the leading dims of each head that rotary turns: head_dim, or fewer (partial rotary)
    max_model_len: int  # positions the worker serves
    windows: tuple[int, ...]  # each layer's sliding window; 0 where it attends fully
    eos_token_ids: tuple[int, ...]
    hf_config: Any  # the transformers config, for rotary parameters

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        for name in sizes:
            if getattr(self, name) <= 0:
                raise ValueError(f"the config.json's {name} is {getattr(self, name)}; it must be above 0")
        outside = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(
                f"eos_token_id {outside} is not a token of the vocabulary (0..{self.vocab_size - 1})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} attention heads do not split into {self.num_kv_heads} KV heads"
            )

    @property
    def num_parameters(self) -> int:
        """Matrix parameters, the embedding counted once when tied (the FLOP count uses this)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embeddings

    @property
    def kv_groups(self) -> KVGroups:
        """How its layers share pool pages: one group, unless some layers slide and others do not."""
        return kv_groups(self.windows)

    def pool_shape(self, dtype: DType, page_size: int) -> PoolShape:
        """The shape of a pool for it: a page holds one group of its layers."""
        return PoolShape(self.kv_groups.size, self.num_kv_heads, self.head_dim, dtype, page_size)

    @classmethod
    def from_hf(
        cls, config: PretrainedConfig, eos_token_ids: tuple[int, ...] = (), *, qk_norm: bool = False
    ) -> ModelSpec:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=qk_norm,
            rotary_dim=rotary_dim(config, head_dim),
            max_model_len=config.max_position_embeddings,
            windows=layer_windows(config),
            eos_token_ids=eos_token_ids,
            hf_config=config,
        )


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The config's rotary parameters (those of layer_type's layers, where each type has its own)."""
    # transformers 5 calls it rope_parameters; 4.x had rope_scaling beside rope_theta.
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        return dict(rope[layer_type])
    return rope


def partial_rotary_factor(config: PretrainedConfig) -> float:
    """The share of each head that rotary turns: 1, unless the config has partial rotary (Phi-4-mini), at its
    top or among its rotary parameters."""
    return rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))


def rotary_dim(config: PretrainedConfig, head_dim: int) -> int:
    """The leading dims of each head that rotary turns."""
    return int(head_dim * partial_rotary_factor(config))


def layer_windows(config: PretrainedConfig) -> tuple[int, ...]:
    """Each layer's sliding window (0: it attends fully), as transformers reads the config: `layer_types`
    where the config has them, else `sliding_window` for every layer (Mistral, Phi-3, Mixtral)."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (window,) * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


def eos_token_ids(model_dir: Path, config: PretrainedConfig) -> tuple[int, ...]:
    ids: list[int] = []
    sources: list[Any] = [getattr(config, "eos_token_id", None)]
    if (model_dir / "generation_config.json").exists():
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for source in sources:
        for token in source if isinstance(source, list | tuple) else [source]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)
