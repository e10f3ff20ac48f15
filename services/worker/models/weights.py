"""Loading Hugging Face safetensors into the worker's fused weight layout.

Q, K and V projections become one matrix, as do the MLP's gate and up projections, so that a layer runs
four GEMMs instead of seven; a checkpoint that fuses them already (Phi-3's `qkv_proj`, `gate_up_proj`) loads
as it is. A mixture of experts' layer stacks its experts into [E, 2I, H] and [E, H, I], whichever names the
checkpoint gives them (Mixtral's w1, w3, w2 under `block_sparse_moe`; Qwen3-MoE's gate, up and down under
`mlp`; gpt-oss's stacked, transposed and interleaved tensors, with biases). Biases and norms are kept
wherever the checkpoint has them; the family says what each one means. A linear layer's weight that the
checkpoint stores in 8 bits with its scale (compressed-tensors) loads as it is (models.quantized).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.kernels.backend import ExpertWeights, Weight
from services.worker.models.quantized import SCALE_SUFFIX, STORED_DTYPES, concat, stored, with_rows
from services.worker.models.spec import ModelSpec

# Where a layer's experts sit, and each expert's gate, up and down projections.
EXPERT_LAYOUTS = {"mlp.": ("gate_proj", "up_proj", "down_proj"), "block_sparse_moe.": ("w1", "w3", "w2")}


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # [H]; OLMo 2 has none
    qkv: Weight  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] per head (Qwen3), or [Hq D] over the whole projection (OLMo 2)
    k_norm: torch.Tensor | None
    o: Weight  # [H, Hq D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]: the checkpoint's post_attention_layernorm
    pre_mlp_norm: torch.Tensor | None  # [H]: pre_feedforward_layernorm (Gemma)
    post_mlp_norm: torch.Tensor | None  # [H]: post_feedforward_layernorm (OLMo 2, Gemma)
    gate_up: Weight | None  # [2 I, H]; None in a layer of experts
    gate_up_bias: torch.Tensor | None
    down: Weight | None  # [H, I]
    down_bias: torch.Tensor | None
    experts: ExpertWeights | None
    sinks: torch.Tensor | None  # [Hq]: each head's attention sink logit (gpt-oss)


@dataclass
class Weights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: Weight  # [V, H]; the embedding itself when tied (unless quantized or packed)

    def map_linears(self, change: Callable[[Weight], Weight]) -> None:
        """Every linear layer's weight (the attention's, a dense MLP's, the vocabulary projection's) through
        change, in place; the embedding's lookup keeps its own."""
        for layer in self.layers:
            layer.qkv = change(layer.qkv)
            layer.o = change(layer.o)
            if layer.gate_up is not None and layer.down is not None:
                layer.gate_up = change(layer.gate_up)
                layer.down = change(layer.down)
        self.lm_head = change(self.lm_head)


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


class Checkpoint:
    """A checkpoint's tensors, each taken once: in the model's dtype and on its device, but for a linear
    layer's weight that it stores in 8 bits, which keeps its bits and takes its scale along."""

    # Activation and KV-cache scales of a quantized checkpoint: pagedserve keeps those in the model's dtype.
    UNUSED = ("rotary_emb", ".input_scale", ".output_scale", ".k_scale", ".v_scale")

    def __init__(
        self, tensors: dict[str, torch.Tensor], spec: ModelSpec, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.tensors, self.spec, self.dtype, self.device = tensors, spec, dtype, device

    def pop(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"the checkpoint has no tensor {name!r}; is it a {self.spec.model_type} model?")
        return self.tensors.pop(name)

    def take(self, name: str) -> torch.Tensor:
        tensor = self.pop(name)
        if tensor.dtype in STORED_DTYPES:
            raise ValueError(f"{name} is stored in 8 bits; pagedserve loads only linear layers' weights so")
        return self._finite(name, tensor.to(device=self.device, dtype=self.dtype))

    def take_linear(self, name: str) -> Weight:
        tensor = self.pop(name)
        if tensor.dtype not in STORED_DTYPES:
            return self._finite(name, tensor.to(device=self.device, dtype=self.dtype))
        weight = stored(tensor, self.pop(name + SCALE_SUFFIX), self.device)
        if weight.data.is_floating_point():  # float8: a NaN byte (e4m3fn holds no infinity)
            self._finite(name, weight.data)
        self._finite(name + SCALE_SUFFIX, weight.scale)
        return weight

    def _finite(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """tensor, unless it holds a NaN or an infinity: a damaged checkpoint, or values past the model
        dtype's range, would serve NaN logprobs and tokens of no meaning, and report SERVING."""
        # A sum is NaN or infinite where an element is; torch's isfinite took 30 times as long on bf16.
        if not torch.isfinite(tensor.float().sum()):
            raise ValueError(
                f"{name} holds NaN or infinite values in {str(tensor.dtype).removeprefix('torch.')}: is the "
                "checkpoint damaged, or its values past that dtype's range?"
            )
        return tensor

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.tensors else None

    def maybe_linear(self, name: str) -> Weight | None:
        return self.take_linear(name) if name in self.tensors else None

    def projection(self, prefix: str, parts: tuple[str, ...], whole: str) -> Weight | None:
        """The parts' weights fused into one (or the checkpoint's own fused one): quantized, or not."""
        separate = [self.maybe_linear(f"{prefix}{part}.weight") for part in parts]
        if all(part is None for part in separate):
            return self.maybe_linear(f"{prefix}{whole}.weight")
        if any(part is None for part in separate):
            raise KeyError(f"the checkpoint has some but not all of {parts}")
        widths = [list(part.shape) for part in separate]  # type: ignore[union-attr]
        if len({shape[1] for shape in widths}) > 1:
            named = f"{', '.join(parts[:-1])} and {parts[-1]}"
            found = f"{', '.join(map(str, widths[:-1]))} and {widths[-1]}"
            raise ValueError(f"{prefix}{named} are {found}: not one width")
        return concat(separate)  # type: ignore[arg-type]

    def bias(self, prefix: str, parts: tuple[str, ...], whole: str) -> torch.Tensor | None:
        """The parts' biases fused into one, as projection() fuses their weights."""
        separate = [self.maybe(f"{prefix}{part}.bias") for part in parts]
        if all(part is None for part in separate):
            return self.maybe(f"{prefix}{whole}.bias")
        if any(part is None for part in separate):
            raise KeyError(f"the checkpoint has some but not all of {parts} (biases)")
        return torch.cat(separate)  # type: ignore[arg-type]

    def check_all_taken(self) -> None:
        leftover = [name for name in self.tensors if not any(part in name for part in self.UNUSED)]
        if leftover:
            raise KeyError(f"the checkpoint has tensors this model does not use: {leftover[:5]}")


def weights_from_state_dict(
    tensors: dict[str, torch.Tensor], spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> Weights:
    checkpoint = Checkpoint(tensors, spec, dtype, device)
    take, maybe = checkpoint.take, checkpoint.maybe
    layers = []
    for i in range(spec.num_layers):
        layer, attn, mlp = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv_parts, gate_up_parts = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
        gate_up = checkpoint.projection(mlp, gate_up_parts, "gate_up_proj")
        layers.append(
            LayerWeights(
                input_norm=maybe(f"{layer}input_layernorm.weight"),
                qkv=_required(checkpoint.projection(attn, qkv_parts, "qkv_proj"), f"{attn}q_proj.weight"),
                qkv_bias=checkpoint.bias(attn, qkv_parts, "qkv_proj"),
                q_norm=maybe(f"{attn}q_norm.weight"),
                k_norm=maybe(f"{attn}k_norm.weight"),
                o=checkpoint.take_linear(f"{attn}o_proj.weight"),
                o_bias=maybe(f"{attn}o_proj.bias"),
                post_norm=take(f"{layer}post_attention_layernorm.weight"),
                pre_mlp_norm=maybe(f"{layer}pre_feedforward_layernorm.weight"),
                post_mlp_norm=maybe(f"{layer}post_feedforward_layernorm.weight"),
                gate_up=gate_up,
                gate_up_bias=checkpoint.bias(mlp, gate_up_parts, "gate_up_proj"),
                down=checkpoint.take_linear(f"{mlp}down_proj.weight") if gate_up is not None else None,
                down_bias=maybe(f"{mlp}down_proj.bias"),
                experts=None if gate_up is not None else _experts(layer, take, maybe),
                sinks=maybe(f"{attn}sinks"),
            )
        )
        if spec.qk_norm and layers[-1].q_norm is None:
            raise KeyError(f"layer {i} has no q_norm weight, which {spec.model_type} needs")
        _check_layer(layers[-1], spec, layer)
        if spec.rotary_dim < spec.head_dim:
            _lay_out_for_partial_rotary(layers[-1], spec)
    embed = take("model.embed_tokens.weight")
    lm_head = checkpoint.maybe_linear("lm_head.weight")
    if spec.tie_word_embeddings:
        lm_head = embed  # as transformers does, whatever copy the checkpoint carries
    elif lm_head is None:
        raise KeyError("the checkpoint has no lm_head.weight and does not tie it to the embedding")
    norm = take("model.norm.weight")
    checkpoint.check_all_taken()
    vocab, hidden = spec.vocab_size, spec.hidden_size
    _expect("model.embed_tokens.weight", embed, (vocab, hidden))
    _expect("lm_head.weight", lm_head, (vocab, hidden))
    _expect("model.norm.weight", norm, (hidden,))
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)


def _expect(name: str, tensor: Weight | None, *shapes: tuple[int, ...]) -> None:
    """ValueError unless the tensor (where there is one) has one of the shapes the config gives: a
    checkpoint that does not match its config would load, serve, and fail every request."""
    if tensor is not None and tuple(tensor.shape) not in shapes:
        wanted = " or ".join(str(list(shape)) for shape in shapes)
        raise ValueError(f"{name} is {list(tensor.shape)}, where the config.json gives {wanted}")


def _check_layer(layer: LayerWeights, spec: ModelSpec, prefix: str) -> None:
    hidden, dim = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * dim, spec.num_kv_heads * dim
    _expect(f"{prefix}self_attn q, k and v", layer.qkv, (q + 2 * kv, hidden))
    _expect(f"{prefix}self_attn q, k and v's bias", layer.qkv_bias, (q + 2 * kv,))
    _expect(f"{prefix}self_attn.q_norm.weight", layer.q_norm, (dim,), (q,))
    _expect(f"{prefix}self_attn.k_norm.weight", layer.k_norm, (dim,), (kv,))
    _expect(f"{prefix}self_attn.o_proj.weight", layer.o, (hidden, q))
    _expect(f"{prefix}self_attn.sinks", layer.sinks, (spec.num_heads,))
    for name in ("input_norm", "post_norm", "pre_mlp_norm", "post_mlp_norm", "o_bias", "down_bias"):
        _expect(f"{prefix}{name}", getattr(layer, name), (hidden,))
    if layer.gate_up is not None:
        inner = layer.gate_up.shape[0] // 2
        _expect(f"{prefix}mlp gate and up", layer.gate_up, (2 * inner, hidden))
        _expect(f"{prefix}mlp gate and up's bias", layer.gate_up_bias, (2 * inner,))
        _expect(f"{prefix}mlp.down_proj.weight", layer.down, (hidden, inner))
    if layer.experts is not None:
        experts = layer.experts
        count, inner = experts.router.shape[0], experts.down.shape[-1]
        _expect(f"{prefix}router", experts.router, (count, hidden))
        _expect(f"{prefix}router's bias", experts.router_bias, (count,))
        _expect(f"{prefix}experts' gate and up", experts.gate_up, (count, 2 * inner, hidden))
        _expect(f"{prefix}experts' gate and up bias", experts.gate_up_bias, (count, 2 * inner))
        _expect(f"{prefix}experts' down", experts.down, (count, hidden, inner))
        _expect(f"{prefix}experts' down bias", experts.down_bias, (count, hidden))


def _experts(
    layer: str,
    take: Callable[[str], torch.Tensor],
    maybe: Callable[[str], torch.Tensor | None],
) -> ExpertWeights:
    """A layer's router and its experts, stacked; KeyError when the layer has neither an MLP nor experts."""
    fused = maybe(f"{layer}mlp.experts.gate_up_proj")
    if fused is not None:  # gpt-oss: [E, H, 2 I] with gate and up interleaved, down [E, I, H]
        bias = take(f"{layer}mlp.experts.gate_up_proj_bias")
        return ExpertWeights(
            router=take(f"{layer}mlp.router.weight"),
            router_bias=take(f"{layer}mlp.router.bias"),
            gate_up=torch.cat((fused[..., ::2], fused[..., 1::2]), dim=-1).transpose(1, 2).contiguous(),
            gate_up_bias=torch.cat((bias[:, ::2], bias[:, 1::2]), dim=-1).contiguous(),
            down=take(f"{layer}mlp.experts.down_proj").transpose(1, 2).contiguous(),
            down_bias=take(f"{layer}mlp.experts.down_proj_bias"),
        )
    for block, (gate, up, down) in EXPERT_LAYOUTS.items():
        router = maybe(f"{layer}{block}gate.weight")
        if router is None:
            continue
        names = [f"{layer}{block}experts.{e}." for e in range(router.shape[0])]
        return ExpertWeights(
            router=router,
            gate_up=torch.stack(
                [torch.cat((take(f"{n}{gate}.weight"), take(f"{n}{up}.weight"))) for n in names]
            ),
            down=torch.stack([take(f"{n}{down}.weight") for n in names]),
        )
    raise KeyError(f"the checkpoint has no {layer}mlp.gate_proj.weight, nor a router for experts")


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A head's dims in the order the kernels' half-split rotary turns partial rotary's: transformers turns
    dims i and i + rotary_dim / 2 of the leading rotary_dim together, the kernels i and i + head_dim / 2; so
    each half holds one half of the turned dims, then one half of the others."""
    turned, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = [*range(turned), *range(rotary_dim, rotary_dim + rest)]
    second = [*range(turned, rotary_dim), *range(rotary_dim + rest, head_dim)]
    return torch.tensor(first + second)


def _lay_out_for_partial_rotary(layer: LayerWeights, spec: ModelSpec) -> None:
    """Permute each query and key head's dims as rotary_order says (and their Q/K norms): queries and keys
    permuted alike give the same scores, and values are left as they are."""
    order = rotary_order(spec.head_dim, spec.rotary_dim)
    q_heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = torch.cat([head * d + order for head in range(q_heads + kv_heads)])  # q heads, then k heads
    turned = slice(0, (q_heads + kv_heads) * d)
    layer.qkv = with_rows(layer.qkv, turned, rows)
    if layer.qkv_bias is not None:
        layer.qkv_bias = with_rows(layer.qkv_bias, turned, rows)  # type: ignore[assignment]
    for name in ("q_norm", "k_norm"):
        norm = getattr(layer, name)
        if norm is not None:  # [D] per head, or [heads D]
            heads = norm.numel() // d
            setattr(layer, name, norm.view(heads, d)[:, order.to(norm.device)].reshape(norm.shape))


def _required(tensor: Weight | None, name: str) -> Weight:
    if tensor is None:
        raise KeyError(f"the checkpoint has no tensor {name!r}")
    return tensor
