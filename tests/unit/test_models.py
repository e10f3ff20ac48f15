"""The model registry (services.worker.models.registry): which family runs a config, and what is refused at
load with a message that says why. Each family's parity with transformers is in test_engine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.kernels.torch_ref import TorchBackend
from services.worker.models import SUPPORTED, CausalLM, ModelRefused, load_model
from services.worker.models.gemma import Gemma2, Gemma3
from services.worker.models.gpt_oss import GptOss
from services.worker.models.granite import Granite
from services.worker.models.mixtral import Mixtral
from services.worker.models.olmo2 import Olmo2
from services.worker.models.qwen3_moe import Qwen3Moe
from tests.models import make_model

CPU = torch.device("cpu")


def load(folder: Path, max_model_len: int | None = None, **changes: object) -> CausalLM:
    """load_model on folder, with changes made to its config.json first."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return load_model(
        folder, dtype=torch.float32, device=CPU, backend=TorchBackend(), max_model_len=max_model_len
    )


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    return make_model("llama", tmp_path)


@pytest.mark.parametrize(
    ("family", "cls"),
    [
        ("granite-multipliers", Granite),
        ("olmo2-postnorm", Olmo2),
        ("gemma2-softcap", Gemma2),
        ("gemma3-local-global", Gemma3),
        ("mixtral-moe", Mixtral),
        ("qwen3-moe", Qwen3Moe),
        ("gpt-oss", GptOss),
    ],
)
def test_the_config_picks_the_family(family: str, cls: type, tmp_path: Path) -> None:
    assert type(load(make_model(family, tmp_path))) is cls


def test_an_unknown_model_type_is_refused_naming_every_supported_one(llama: Path) -> None:
    with pytest.raises(ValueError) as refused:
        load(llama, model_type="cohere")
    assert (
        str(refused.value) == f"model_type 'cohere' is not supported; pagedserve runs {', '.join(SUPPORTED)}"
    )


def test_a_model_that_is_not_a_causal_lm_is_refused(llama: Path) -> None:
    with pytest.raises(ValueError, match="LlamaForSequenceClassification is not a causal language model"):
        load(llama, architectures=["LlamaForSequenceClassification"])


def test_rotary_this_code_does_not_compute_is_refused(llama: Path) -> None:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.1875}  # 3 of 16 dims
    with pytest.raises(ValueError, match="partial rotary over 3 of 16 dims: both parts must be even"):
        load(llama, rope_parameters=rope)
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        load(llama, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})


def test_a_quantized_checkpoint_is_refused_naming_its_method(llama: Path) -> None:
    with pytest.raises(ValueError, match=r"the checkpoint is quantized \(mxfp4\)"):
        load(llama, quantization_config={"quant_method": "mxfp4"})


def test_experts_where_the_config_puts_none_are_refused(tmp_path: Path) -> None:
    folder = make_model("qwen3-moe", tmp_path)  # experts in layer 0 alone
    with pytest.raises(ValueError, match=r"experts in layers \[0\], its config in layers \[0, 1\]"):
        load(folder, mlp_only_layers=[])


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path: Path) -> None:
    folder = make_model("mixtral-moe", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    missing = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    del tensors[missing]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelRefused, match=re.escape(f"no tensor {missing!r}")):
        load(folder)


SHAPES = [  # a tensor replaced by one of this shape, and what the refusal says
    ("model.layers.0.self_attn.q_proj.weight", (64, 32), "q_proj, k_proj and v_proj are .* not one width"),
    (
        "model.layers.1.input_layernorm.weight",
        (7,),
        r"input_norm is \[7\], where the config.json gives \[64\]",
    ),
    ("model.layers.0.mlp.down_proj.weight", (64, 100), r"down_proj.weight is \[64, 100\], where"),
    ("model.embed_tokens.weight", (300, 64), r"embed_tokens.weight is \[300, 64\], where .* \[512, 64\]"),
]


@pytest.mark.parametrize(("name", "shape", "expected"), SHAPES)
def test_a_tensor_of_another_shape_than_the_config_gives_is_refused_naming_it(
    llama: Path, name: str, shape: tuple[int, ...], expected: str
) -> None:
    """Else the worker would load it, report SERVING, and fail every request in its first step."""
    tensors = load_file(llama / "model.safetensors")
    tensors[name] = torch.zeros(shape)
    save_file(tensors, llama / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelRefused, match=expected):
        load(llama)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"num_attention_heads": 0}, "its config.json divides by zero"),
        ({"vocab_size": 0}, "vocab_size is 0; it must be above 0"),
        ({"vocab_size": 10**9}, r"is \[512, 64\], where the config.json gives \[1000000000, 64\]"),
        ({"num_hidden_layers": 3}, "no tensor 'model.layers.2"),
        ({"eos_token_id": -5}, r"eos_token_id \[-5\] is not a token of the vocabulary \(0..511\)"),
        ({"num_hidden_layers": "2"}, "'num_hidden_layers' expected int, got str"),
        ({"quantization_config": []}, "its config.json has a field of the wrong type"),
        ({"max_position_embeddings": 10**12}, r"rotary table of .* a shorter one with --max-model-len"),
    ],
)  # fmt: skip
def test_a_config_that_does_not_fit_its_checkpoint_is_refused(
    llama: Path, changes: dict[str, object], expected: str
) -> None:
    """Before anything is sized by the config: a vocabulary of 10**9 must be refused, not allocated."""
    with pytest.raises(ModelRefused, match=expected):
        load(llama, **changes)


def test_a_shorter_context_than_the_configs_sizes_the_rotary_tables_by_it(llama: Path) -> None:
    """--max-model-len: a config of 10**12 positions (refused above) serves a context of 64."""
    model = load(llama, max_model_len=64, max_position_embeddings=10**12)
    assert model.spec.max_model_len == 64
    assert {layer.cos_sin.shape[0] for layer in model.layers} == {64}


@pytest.mark.parametrize(
    ("value", "dtype"), [(float("nan"), torch.float32), (float("-inf"), torch.float32), (1e5, torch.float16)]
)
def test_a_weight_that_is_not_finite_in_the_models_dtype_is_refused(
    llama: Path, value: float, dtype: torch.dtype
) -> None:
    """A damaged checkpoint, or a value past the dtype's range (fp16's is 65504), would serve NaNs."""
    tensors = load_file(llama / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"][0, 0] = value
    save_file(tensors, llama / "model.safetensors", metadata={"format": "pt"})
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ModelRefused, match=f"k_proj.weight holds NaN or infinite values in {name}"):
        load_model(llama, dtype=dtype, device=CPU, backend=TorchBackend())
