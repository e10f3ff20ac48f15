"""8-bit weights for the linear layers: quantized at load (`--quantization int8`), or read as a checkpoint
stores them in compressed-tensors' format (as vLLM loads it), without quantizing again.

At load, each weight gets one float32 scale per output row (symmetric, per channel): max |w| / 127, so the
row's largest value is exact and the rest round to the nearest of 255 steps. The linear layers are the
attention's QKV and output projections, the dense MLP's, and the vocabulary projection (a copy of the
embedding's, where the two are tied: the embedding's lookup keeps the model's dtype); a mixture of experts'
weights keep the model's dtype. The backends take the product in float32 with the scale applied to the sums
(pagedserve.kernels.backend.QuantizedWeight), so activations stay in the model's dtype (weight-only). The
exception is the CPU backend's weights packed for vpdpbusd (on a CPU that runs AVX512-VNNI; for a bfloat16
model, AVX512-BF16 too): each activation row is rounded to int8 with a scale of its own (W8A8, dynamic per
token), which took half the time of int8 weights widened to bfloat16 at 256 rows, and a fifth of their time
widened to float32 (scripts/bench_quantized.py), and costs accuracy (the README's table).

A compressed-tensors checkpoint (config.json's quantization_config, quant_method "compressed-tensors")
loads where each quantized weight is int8 or float8 (e4m3), symmetric, with a scale per output channel or one
per tensor (`<name>.weight_scale`): the formats llm-compressor writes for W8A8 and FP8 models. Its
activation settings (dynamic int8 or float8 inputs) are not read: its int8 weights run as those quantized at
load do (W8A8 where the CPU backend packs them, weight-only elsewhere), its float8 ones weight-only.
Anything else (4-bit, groups, blocks, zero points) is refused with its reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.kernels.backend import PackedWeight, QuantizedWeight, Weight, plain_weight

if TYPE_CHECKING:
    from services.worker.models.weights import Weights

STORED_DTYPES = (torch.int8, torch.float8_e4m3fn)  # what a checkpoint's 8-bit weights may be
SCALE_SUFFIX = "_scale"  # compressed-tensors stores <module>.weight beside <module>.weight_scale


def int8_activations(weights: Weights) -> bool:
    """Whether the linear layers round their activations to int8 a row (W8A8): int8 weights packed for
    vpdpbusd, with each row's sums."""
    qkv = weights.layers[0].qkv
    return isinstance(qkv, PackedWeight) and qkv.sums is not None


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """weight [N, K] as int8 with one scale a row: max |w| / 127 (1 for a row of zeros)."""
    wide = weight.float()
    scale = wide.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = torch.round(wide / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(data.contiguous(), scale.contiguous())


def quantize_linears(weights: Weights) -> None:
    """Every linear layer's weight of a loaded model to int8, in place; a weight the checkpoint stored
    quantized stays as it is."""

    def quantized(weight: Weight) -> Weight:
        plain = plain_weight(weight)
        return plain if isinstance(plain, QuantizedWeight) else quantize_int8(plain)

    weights.map_linears(quantized)


def stored(weight: torch.Tensor, scale: torch.Tensor, device: torch.device) -> QuantizedWeight:
    """A checkpoint's 8-bit weight [N, K] with its scale ([N, 1] or [N] per channel, [1] or [] per tensor)."""
    rows = weight.shape[0]
    wide = scale.float().flatten()
    if wide.numel() == 1:
        wide = wide.expand(rows)
    if wide.numel() != rows:
        raise ValueError(f"a weight scale shaped {tuple(scale.shape)} fits neither {rows} rows nor a tensor")
    return QuantizedWeight(weight.contiguous().to(device), wide.contiguous().to(device))


def concat(parts: list[Weight]) -> Weight:
    """Weights of one input stacked by rows (Q, K and V; gate and up): all quantized, or none."""
    plain = [part for part in parts if isinstance(part, torch.Tensor)]
    if len(plain) == len(parts):
        return torch.cat(plain)
    quantized = [part for part in parts if isinstance(part, QuantizedWeight)]
    if len(quantized) != len(parts):
        raise ValueError("the checkpoint quantizes some but not all of the projections pagedserve fuses")
    return QuantizedWeight(torch.cat([q.data for q in quantized]), torch.cat([q.scale for q in quantized]))


def with_rows(weight: Weight, rows: slice, source: torch.Tensor) -> Weight:
    """A copy of weight whose rows[rows] are its rows[source] (a permutation of some of its rows)."""
    weight = plain_weight(weight)
    if isinstance(weight, QuantizedWeight):
        source = source.to(weight.data.device)
        data, scale = weight.data.clone(), weight.scale.clone()
        data[rows], scale[rows] = weight.data[source], weight.scale[source]
        return QuantizedWeight(data, scale)
    source = source.to(weight.device)
    out = weight.clone()
    out[rows] = weight[source]
    return out


def check_checkpoint(quantization: dict[str, Any]) -> None:
    """Refuse, with ValueError, a quantization_config whose weights this code does not compute exactly."""
    method = quantization.get("quant_method", "?")
    if method != "compressed-tensors":
        raise ValueError(
            f"the checkpoint is quantized ({method}); pagedserve loads unquantized weights (bf16, fp16 or "
            "fp32), or int8 and FP8 weights in compressed-tensors' format"
        )
    groups = quantization.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(
        isinstance(group, dict) and isinstance(group.get("weights") or {}, dict) for group in groups.values()
    ):
        raise ValueError(
            "the checkpoint's quantization_config.config_groups is not compressed-tensors' mapping of group "
            'names to schemes, each with its "weights" scheme as a mapping'
        )
    for name, group in groups.items():
        scheme = group.get("weights") or {}
        kind, bits, strategy = scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy")
        problems = [
            *([f"{bits}-bit weights"] if bits != 8 else []),
            *([f"weights of type {kind}"] if kind not in ("int", "float") else []),
            *([f"the {strategy} strategy"] if strategy not in ("channel", "tensor") else []),
            *(["asymmetric weights"] if not scheme.get("symmetric", True) else []),
            *(["dynamic weight scales"] if scheme.get("dynamic") else []),
        ]
        if problems:
            raise ValueError(
                f"the checkpoint's {name} has {', '.join(problems)}; pagedserve loads compressed-tensors "
                "checkpoints of symmetric 8-bit int or float weights, scaled per channel or per tensor"
            )
