"""Loading Hugging Face safetensors into the worker's fused weight layout.

Q, K and V projections become one matrix, as do the MLP's gate and up projections, so that a layer runs
four GEMMs instead of seven. Biases are kept wherever the checkpoint has them (Qwen2's QKV bias, Llama's
optional attention and MLP biases).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.models.spec import ModelSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D], Qwen3
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [H, Hq D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None


@dataclass
class Weights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied


def load_weights(model_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> Weights:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}; pagedserve loads safetensors checkpoints")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    return weights_from_state_dict(tensors, spec, dtype, device)


def weights_from_state_dict(
    tensors: dict[str, torch.Tensor], spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> Weights:
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"the checkpoint has no tensor {name!r}; is it a {spec.model_type} model?")
        return tensors.pop(name).to(device=device, dtype=dtype)

    def maybe(name: str) -> torch.Tensor | None:
        return take(name) if name in tensors else None

    def fused(*names: str) -> torch.Tensor | None:
        parts = [maybe(name) for name in names]
        if all(part is None for part in parts):
            return None
        if any(part is None for part in parts):
            raise KeyError(f"the checkpoint has some but not all of {names}")
        return torch.cat(parts)  # type: ignore[arg-type]

    layers = []
    for i in range(spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layers.append(
            LayerWeights(
                input_norm=take(f"model.layers.{i}.input_layernorm.weight"),
                qkv=fused(f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"),  # type: ignore[arg-type]
                qkv_bias=fused(f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"),
                q_norm=maybe(f"{attn}q_norm.weight"),
                k_norm=maybe(f"{attn}k_norm.weight"),
                o=take(f"{attn}o_proj.weight"),
                o_bias=maybe(f"{attn}o_proj.bias"),
                post_norm=take(f"model.layers.{i}.post_attention_layernorm.weight"),
                gate_up=fused(f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"),  # type: ignore[arg-type]
                gate_up_bias=fused(f"{mlp}gate_proj.bias", f"{mlp}up_proj.bias"),
                down=take(f"{mlp}down_proj.weight"),
                down_bias=maybe(f"{mlp}down_proj.bias"),
            )
        )
        if spec.qk_norm and layers[-1].q_norm is None:
            raise KeyError(f"layer {i} has no q_norm weight, which {spec.model_type} needs")
    embed = take("model.embed_tokens.weight")
    lm_head = maybe("lm_head.weight")
    if spec.tie_word_embeddings:
        lm_head = embed  # as transformers does, whatever copy the checkpoint carries
    elif lm_head is None:
        raise KeyError("the checkpoint has no lm_head.weight and does not tie it to the embedding")
    norm = take("model.norm.weight")
    leftover = [name for name in tensors if "rotary_emb" not in name]
    if leftover:
        raise KeyError(f"the checkpoint has tensors this model does not use: {leftover[:5]}")
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
