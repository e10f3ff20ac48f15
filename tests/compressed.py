"""Quantized copies of the small test models in the compressed-tensors format (quant_method
"compressed-tensors"), the format vLLM loads and llm-compressor writes.

The compressed-tensors library does the work: its preset schemes, its qparams and its compressors, so that
the files are the ones the library writes. Only the min/max of each weight row, what llm-compressor's
min-max observer feeds to the same `calculate_qparams`, is taken here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal, cast

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStrategy,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
from transformers import AutoModelForCausalLM

# The library's presets: int8 or fp8 weights per output channel, symmetric, with dynamic per-token inputs.
PRESETS: dict[str, str] = {"int8": "W8A8", "fp8": "FP8_DYNAMIC"}


def compress_checkpoint(source: Path, target: Path, scheme: Literal["int8", "fp8"]) -> Path:
    """Write into target a compressed-tensors checkpoint of the model folder source (saved by
    save_pretrained): every Linear of the decoder layers quantized by the preset of scheme, lm_head left
    as it is, config.json with the library's quantization_config, and source's tokenizer files."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    config = QuantizationConfig(config_groups={PRESETS[scheme]: ["Linear"]}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and is_module_quantized(module):
                _observe_weight(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)  # weights become int8 / float8_e4m3fn; symmetric zero points dropped
    model.save_pretrained(target)
    compressor.update_config(str(target))
    for file in source.iterdir():
        if file.is_file() and not (target / file.name).exists() and not _is_weights(file):
            shutil.copy2(file, target / file.name)
    return target


def _observe_weight(module: torch.nn.Linear) -> None:
    """Set the module's weight scale (and zero point) from each output row's min and max, by the library."""
    args = cast(QuantizationScheme, module.quantization_scheme).weights
    if args is None or args.strategy != QuantizationStrategy.CHANNEL:
        raise ValueError(f"expected per-channel weights, got {args}")
    weight = module.weight
    scale, zero_point = calculate_qparams(
        weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True), args
    )
    update_offload_parameter(module, "weight_scale", scale.to(module.weight_scale.dtype))
    if hasattr(module, "weight_zero_point"):
        update_offload_parameter(module, "weight_zero_point", zero_point.to(module.weight_zero_point.dtype))


def _is_weights(file: Path) -> bool:
    return file.suffix in (".safetensors", ".bin", ".pt") or file.name.endswith(".index.json")
