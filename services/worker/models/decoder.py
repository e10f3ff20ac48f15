"""The shared decoder: a Llama-shaped transformer over a flat batch of tokens and the paged KV pool, whose
steps (the embedding, a block, its attention and MLP, the logits) a family overrides where it differs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.kernels.backend import AttentionMetadata, KernelBackend, LayerAttention, Routing
from services.worker.models.quantized import check_checkpoint
from services.worker.models.spec import ModelSpec, partial_rotary_factor, rope_parameters, rotary_dim
from services.worker.models.weights import LayerWeights, Weights

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rotary_table(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, layer_type: str | None = None
) -> torch.Tensor:
    """cos and sin of every position, [max_model_len, 2, D], computed as transformers computes them, for
    the layers of layer_type where the config gives each its own (Gemma 3: "sliding_attention").

    With partial rotary (spec.rotary_dim < D), the table is for heads laid out as weights.rotary_order has
    them: the dims rotary leaves alone get a cos of 1 and a sin of 0.

    Long RoPE (Phi-3) has a short and a long set of factors, and transformers picks the long one for a
    forward pass that reaches past original_max_position_embeddings. A paged cache keeps keys rotated once,
    so one set serves: the long one when the served context reaches past the original length (as vLLM
    does), which agrees with transformers for every sequence that does too.
    """
    config = spec.hf_config
    rope = rope_parameters(config, layer_type)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    per_type = (
        {} if layer_type is None or layer_type not in rope_parameters(config) else {"layer_type": layer_type}
    )
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dims = spec.rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float) / dims))
        scaling = 1.0
    else:
        init = ROPE_INIT_FUNCTIONS[rope_type]
        seq_len = {"seq_len": spec.max_model_len} if rope_type == "longrope" else {}
        inv_freq, scaling = init(config, torch.device("cpu"), **seq_len, **per_type)
    positions = torch.arange(spec.max_model_len, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    unturned = (spec.head_dim - spec.rotary_dim) // 2
    cos = torch.cat((freqs.cos() * scaling, torch.ones(len(positions), unturned)), dim=-1)
    sin = torch.cat((freqs.sin() * scaling, torch.zeros(len(positions), unturned)), dim=-1)
    table = torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)), dim=1)
    return table.to(device=device, dtype=dtype)


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its weights, how its attention works, its rotary table, and where its KV lives:
    its group's block tables (services.worker.kv.groups), at its slot of the group's pages."""

    index: int
    weights: LayerWeights
    attention: LayerAttention
    cos_sin: torch.Tensor
    group: int
    slot: int


@dataclass(frozen=True)
class Step:
    """What every layer of one forward pass shares: the tokens' positions [T], the attention metadata of
    each group of layers, and the KV pool [layers a page holds, 2, P, B, Hkv, D]."""

    positions: torch.Tensor
    metas: Sequence[AttentionMetadata]
    kv: torch.Tensor


class CausalLM:
    """A family's forward pass; this one is Llama's, which the families override where they differ."""

    model_types: ClassVar[tuple[str, ...]] = ()  # the config.json model_type values the family serves
    qk_norm: ClassVar[bool] = False  # the checkpoint must have q_norm and k_norm weights

    def __init__(self, spec: ModelSpec, weights: Weights, backend: KernelBackend) -> None:
        self.spec = spec
        self.weights = weights
        self.backend = backend
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        tables: dict[str, torch.Tensor] = {}  # one for each set of rotary parameters the layers use
        groups = spec.kv_groups
        self.layers = []
        for i, layer in enumerate(weights.layers):
            kind = self.layer_type(i)
            key = repr(sorted(rope_parameters(spec.hf_config, kind).items()))
            if key not in tables:
                tables[key] = rotary_table(spec, self.device, self.dtype, kind)
            place = (groups.group_of[i], groups.slot_of[i])
            self.layers.append(Layer(i, layer, self.layer_attention(i), tables[key], *place))
        kv_width = spec.num_kv_heads * spec.head_dim
        self._split = [spec.num_heads * spec.head_dim, kv_width, kv_width]

    @classmethod
    def check(cls, config: PretrainedConfig) -> None:
        """Refuse, with ValueError, a config of the family that this code does not compute exactly."""
        quantization = getattr(config, "quantization_config", None)
        if quantization:
            check_checkpoint(quantization if isinstance(quantization, dict) else quantization.to_dict())
        for kind in {None, *(getattr(config, "layer_types", None) or ())}:
            rope = rope_parameters(config, kind)
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are)")
            if kind is not None and rope.get("partial_rotary_factor") not in (
                None,
                partial_rotary_factor(config),
            ):
                raise ValueError("partial rotary that differs between layer types is not supported")
        if config.num_attention_heads <= 0:
            raise ValueError(f"the config.json's num_attention_heads is {config.num_attention_heads}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        turned = rotary_dim(config, head_dim)
        if turned <= 0 or turned % 2 or (head_dim - turned) % 2:
            raise ValueError(f"partial rotary over {turned} of {head_dim} dims: both parts must be even")

    def layer_type(self, i: int) -> str:
        """Layer i's kind, as the config's layer_types name it."""
        return "sliding_attention" if self.spec.windows[i] else "full_attention"

    def layer_attention(self, i: int) -> LayerAttention:
        """How layer i attends: its scores' scale, its window, its sinks where the checkpoint has them."""
        sinks = self.weights.layers[i].sinks
        return LayerAttention(self.spec.head_dim**-0.5, window=self.spec.windows[i], sinks=sinks)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: Sequence[AttentionMetadata],
        kv: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run T tokens through the model, writing their KV into kv, the pool [layers a page holds, 2, P,
        B, Hkv, D], as metas (one for each group of layers, spec.kv_groups) say.

        input_ids, positions: [T]. Returns fp32 logits [len(logits_indices), V] for the rows asked for.
        """
        step = Step(positions, metas, kv)
        hidden = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = self.block(layer, hidden, residual, step)
        # Only the rows that sample need the final norm and the vocabulary projection.
        rest = None if residual is None else residual[logits_indices]
        x, _ = self.backend.rms_norm(hidden[logits_indices], self.weights.norm, self.spec.rms_norm_eps, rest)
        return self.logits(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weights.embed)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weights.lm_head).float()

    def block(
        self, layer: Layer, hidden: torch.Tensor, residual: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer, pre-norm: the residual stream is hidden + residual (hidden alone while residual is
        None), and the norms add the two as they normalize."""
        be, eps, w = self.backend, self.spec.rms_norm_eps, layer.weights
        x, residual = be.rms_norm(hidden, w.input_norm, eps, residual)  # type: ignore[arg-type]
        hidden = self.attention(layer, x, step)
        x, residual = be.rms_norm(hidden, w.post_norm, eps, residual)
        return self.mlp(layer, x), residual

    def attention(self, layer: Layer, x: torch.Tensor, step: Step) -> torch.Tensor:
        spec, be, w = self.spec, self.backend, layer.weights
        tokens = x.shape[0]
        q, k, v = be.linear(x, w.qkv, w.qkv_bias).split(self._split, dim=-1)
        q = q.view(tokens, spec.num_heads, spec.head_dim)
        k = k.view(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(tokens, spec.num_kv_heads, spec.head_dim)
        if w.q_norm is not None:
            q, k = self.norm_qk(w, q, k)
        q, k = be.rotary(q, k, step.positions, layer.cos_sin)
        kv_layer, meta = step.kv[layer.slot], step.metas[layer.group]
        be.write_kv(kv_layer, k, v, meta.slot_mapping)
        attn = be.paged_attention(q, kv_layer, meta, layer.attention)
        return be.linear(attn.view(tokens, -1), w.o, w.o_bias)

    def norm_qk(self, w: LayerWeights, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q/K norm, on q [T, Hq, D] and k [T, Hkv, D]: each head on its own (Qwen3)."""
        eps = self.spec.rms_norm_eps
        return self.backend.rms_norm(q, w.q_norm, eps)[0], self.backend.rms_norm(k, w.k_norm, eps)[0]  # type: ignore[arg-type]

    def mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        be, w = self.backend, layer.weights
        if w.experts is not None:
            return be.moe(x, w.experts, self.routing)
        return be.linear(self.gated(x, w), w.down, w.down_bias)  # type: ignore[arg-type]

    def gated(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """The MLP's gated activation of x's gate and up projections (fused, [2 I, H]): silu(gate) * up."""
        return self.backend.gated_linear(x, w.gate_up, w.gate_up_bias)  # type: ignore[arg-type]

    @property
    def routing(self) -> Routing:
        """How the model's mixture of experts routes a token."""
        raise ValueError(f"{self.spec.model_type} has no mixture of experts")
