"""Which family's code runs a model: its config.json's `model_type`, checked against `architectures`.

A family is one module holding a `CausalLM` subclass; adding one is that module, a line in FAMILIES, and a
random model of it in tests/models.py, which the engine's parity tests then run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from huggingface_hub import errors as hub_errors
from safetensors import SafetensorError
from transformers import AutoConfig, PretrainedConfig

from pagedserve.kernels.backend import KernelBackend
from pagedserve.plumbing.sizes import physical_memory_bytes
from services.worker.models.decoder import CausalLM
from services.worker.models.gemma import Gemma2, Gemma3
from services.worker.models.gpt_oss import GptOss
from services.worker.models.granite import Granite
from services.worker.models.llama import Llama, Qwen3
from services.worker.models.mixtral import Mixtral
from services.worker.models.olmo2 import Olmo2
from services.worker.models.phi3 import Phi3
from services.worker.models.quantized import quantize_linears
from services.worker.models.qwen3_moe import Qwen3Moe
from services.worker.models.spec import ModelSpec, eos_token_ids
from services.worker.models.weights import load_weights
from services.worker.quantization import Quantization

FAMILIES: tuple[type[CausalLM], ...] = (
    Llama,
    Qwen3,
    Phi3,
    Olmo2,
    Granite,
    Gemma2,
    Gemma3,
    Mixtral,
    Qwen3Moe,
    GptOss,
)
BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
SUPPORTED = tuple(sorted(BY_MODEL_TYPE))
# transformers 5 checks config.json's types as it reads it (a size given as a string); 4.x did not.
CONFIG_TYPE_ERROR = getattr(hub_errors, "StrictDataclassError", ValueError)


class ModelRefused(ValueError):
    """A model this worker will not serve as asked: the worker stops at start and says why."""


def family_of(config: PretrainedConfig) -> type[CausalLM]:
    """The family that runs config; ModelRefused, naming what is supported, when none does."""
    family = BY_MODEL_TYPE.get(config.model_type)
    if family is None:
        raise ModelRefused(
            f"model_type {config.model_type!r} is not supported; pagedserve runs " + ", ".join(SUPPORTED)
        )
    heads = [
        name for name in getattr(config, "architectures", None) or [] if not name.endswith("ForCausalLM")
    ]
    if heads:
        raise ModelRefused(
            f"{', '.join(heads)} is not a causal language model; pagedserve serves *ForCausalLM"
        )
    family.check(config)
    return family


def load_spec(model_dir: Path) -> ModelSpec:
    """The spec of the model in model_dir, by its family; ValueError when no family runs it."""
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (AttributeError, TypeError) as exc:  # transformers' own, on a field of the wrong type
        raise ValueError(f"its config.json has a field of the wrong type ({exc})") from exc
    return ModelSpec.from_hf(config, eos_token_ids(model_dir, config), qk_norm=family_of(config).qk_norm)


def load_model(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    backend: KernelBackend,
    quantization: Quantization = "none",
    max_model_len: int | None = None,
) -> CausalLM:
    """The model in model_dir (config.json and safetensors), on device, through backend; with int8, its
    linear layers' weights quantized (those the checkpoint stores quantized stay as they are); each linear
    layer's weight in the layout backend reads best. Its context is max_model_len where that is shorter
    than the config's max_position_embeddings."""
    try:
        spec = with_context(load_spec(model_dir), max_model_len)
        check_rotary_fits(spec)
        weights = load_weights(model_dir, spec, dtype, device)
    except ModelRefused:
        raise
    except ZeroDivisionError as exc:  # transformers' config, from a size of 0
        raise ModelRefused(f"{model_dir}: its config.json divides by zero ({exc}): is a size 0?") from exc
    except (ValueError, KeyError, OSError, SafetensorError, CONFIG_TYPE_ERROR) as exc:  # config or checkpoint
        reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else " ".join(str(exc).split())
        raise ModelRefused(f"{model_dir}: {reason}") from exc
    if quantization == "int8":
        quantize_linears(weights)
    weights.map_linears(lambda weight: backend.prepare_linear(weight, dtype))
    model = family_of(spec.hf_config)(spec, weights, backend)
    experts = next((layer.experts for layer in weights.layers if layer.experts is not None), None)
    if experts is not None and not 1 <= model.routing.top_k <= experts.router.shape[0]:
        raise ModelRefused(
            f"{model_dir}: num_experts_per_tok is {model.routing.top_k}, where the checkpoint has "
            f"{experts.router.shape[0]} experts a layer"
        )
    return model


def with_context(spec: ModelSpec, max_model_len: int | None) -> ModelSpec:
    """spec, serving at most max_model_len tokens a sequence (None: the config's max_position_embeddings)."""
    if max_model_len is None or max_model_len >= spec.max_model_len:
        return spec
    return dataclasses.replace(spec, max_model_len=max_model_len)


def check_rotary_fits(spec: ModelSpec) -> None:
    """Refuse a context whose rotary table (cos and sin of every position, built in float32 in this
    process's memory) would take more than an eighth of the machine's: a config.json may give 10**12."""
    table_gib = spec.max_model_len * spec.head_dim * 2 * 4 / 2**30
    memory_gib = physical_memory_bytes() / 2**30
    if table_gib > memory_gib / 8:
        raise ModelRefused(
            f"a context of {spec.max_model_len} tokens needs a rotary table of {table_gib:.1f} GiB, more "
            f"than an eighth of this machine's {memory_gib:.1f} GiB: serve a shorter one with --max-model-len"
        )
