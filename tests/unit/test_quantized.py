"""8-bit linear weights: `--quantization int8` computes exactly the model whose weights are its int8 values
times their scales (the engine's greedy tokens equal transformers' on those weights), and a checkpoint that
compressed-tensors wrote in int8 or FP8 loads as stored, not quantized again, and runs exactly the model of
its stored weights. On SmolLM2 itself, int8 stays close to float32. A checkpoint in a scheme that is not
computed exactly is refused with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagedserve.kernels.backend import QuantizedWeight, plain_weight
from pagedserve.kernels.cpu_features import cpu_features
from services.common.default_model import default_model_dir
from services.worker.core.engine import EngineCore
from services.worker.core.engine_config import EngineConfig
from services.worker.kv.local import LocalKVCache
from services.worker.models import CausalLM, ModelRefused, load_model
from services.worker.models.quantized import int8_activations, quantize_int8
from tests.compressed import compress_checkpoint
from tests.kernels.test_cpu_rowwise import int8_rows
from tests.models import make_model
from tests.unit.test_engine import Family, backend, prompts, run, tokens

CPU = torch.device("cpu")
LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
)


def test_int8_rows_keep_their_largest_value_and_round_the_rest_to_the_nearest_step() -> None:
    weight = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    weight[5] = 0.0
    quantized = quantize_int8(weight)
    assert quantized.data.dtype == torch.int8 and quantized.scale.dtype == torch.float32
    assert quantized.scale[5] == 1.0 and not quantized.data[5].any()
    error = (quantized.dequantize() - weight).abs()
    assert bool((error <= quantized.scale[:, None] / 2 + 1e-7).all())
    most = weight.abs().argmax(dim=1)
    rows = torch.arange(64)
    assert torch.allclose(quantized.dequantize()[rows, most], weight[rows, most])


def with_dequantized_int8(hf: PreTrainedModel, int8_rows: bool) -> PreTrainedModel:
    """transformers' model with each linear layer's weight (and lm_head's) replaced by its int8 rounding; a
    tied lm_head gets a copy of its own, as the embedding keeps its dtype. With int8_rows, each of those
    layers rounds its input to int8 a row first, as the CPU backend's W8A8 product does."""
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.clone())
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and (name.endswith(LINEARS) or name == "lm_head"):
                module.weight.copy_(quantize_int8(module.weight).dequantize())
                if int8_rows:
                    module.register_forward_pre_hook(lambda _, args: (rounded_rows(args[0]),))
    return hf


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded to int8 a row, as packed_linear.cpp multiplies it."""
    return int8_rows(x.reshape(-1, x.shape[-1])).reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("kernels", ["torch", "cpu", "cpu-worker"])
@pytest.mark.parametrize("name", ["smollm2-tied", "qwen2-bias", "phi3-partial", "qwen3-moe"])
def test_int8_runs_exactly_the_model_of_its_rounded_weights(name: str, kernels: str, tmp_path: Path) -> None:
    """A tied embedding (its own int8 copy for the logits), biases, a fused and permuted QKV, and experts
    (which keep the model's dtype): greedy tokens equal transformers' on the dequantized weights. With the
    instructions the worker would use (cpu-worker), where vpdpbusd runs, the float32 model's linear layers
    round their activations to int8 a row too (W8A8), and so does the reference."""
    folder = make_model(name, tmp_path)
    model = load_model(folder, dtype=torch.float32, device=CPU, backend=backend(kernels), quantization="int8")
    layer = model.weights.layers[0]
    w8a8 = kernels == "cpu-worker" and cpu_features().avx512_vnni.usable
    assert int8_activations(model.weights) == w8a8
    for weight in (layer.qkv, layer.o, model.weights.lm_head):
        assert isinstance(plain_weight(weight), QuantizedWeight)
    assert model.weights.embed.dtype == torch.float32
    hf = with_dequantized_int8(
        AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval(), w8a8
    )
    family = Family(model, hf, "off")
    batch = prompts(3, 17, 40, seed=11)
    engine = family.engine(max_batched_tokens=32)
    outputs = run(engine, batch)
    for key, prompt in enumerate(batch):
        assert tokens(outputs[key]) == family.reference(prompt)[0], f"prompt {key}"


def with_stored_weights(hf: PreTrainedModel, folder: Path) -> PreTrainedModel:
    """transformers' model with each linear layer's weight replaced by a checkpoint's stored 8-bit weight
    times its scale. (transformers itself runs such a checkpoint with its activations quantized too, as
    its scheme says; the backends here keep activations in the model's dtype.)"""
    with safe_open(folder / "model.safetensors", framework="pt") as stored, torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and f"{name}.weight_scale" in stored.keys():  # noqa: SIM118
                weight, scale = stored.get_tensor(f"{name}.weight"), stored.get_tensor(f"{name}.weight_scale")
                module.weight.copy_(weight.float() * scale.float())
    return hf


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a_compressed_tensors_checkpoint_loads_as_stored_and_runs_its_stored_weights(
    scheme: str, kernels: str, tmp_path: Path
) -> None:
    source = make_model("qwen2-bias", tmp_path / "source")
    folder = compress_checkpoint(source, tmp_path / scheme, scheme)  # type: ignore[arg-type]
    with safe_open(folder / "model.safetensors", framework="pt") as stored:
        q, k, v = (
            stored.get_tensor(f"model.layers.0.self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")
        )
        q_scale = stored.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
    assert q.dtype == (torch.int8 if scheme == "int8" else torch.float8_e4m3fn)
    model = load_model(folder, dtype=torch.float32, device=CPU, backend=backend(kernels))
    qkv = model.weights.layers[0].qkv
    assert isinstance(qkv, QuantizedWeight)
    assert torch.equal(qkv.data.view(torch.uint8), torch.cat((q, k, v)).view(torch.uint8)), "quantized again"
    assert torch.equal(qkv.scale[: q.shape[0]], q_scale.float().flatten())
    hf = with_stored_weights(
        AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager"), folder
    )
    family = Family(model, hf.eval(), "off")
    engine = family.engine(max_batched_tokens=32)
    batch = prompts(5, 40, seed=12)
    outputs = run(engine, batch)
    for key, prompt in enumerate(batch):
        assert tokens(outputs[key]) == family.reference(prompt)[0], f"prompt {key}"


def rewrite_config(folder: Path, change: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_bits": 4}, "4-bit weights"),
        ({"strategy": "group", "group_size": 32}, "the group strategy"),
        ({"symmetric": False}, "asymmetric weights"),
    ],
)
def test_a_scheme_not_computed_exactly_is_refused_with_its_reason(
    change: dict, message: str, tmp_path: Path
) -> None:
    folder = compress_checkpoint(make_model("llama", tmp_path / "source"), tmp_path / "int8", "int8")
    rewrite_config(folder, change)
    with pytest.raises(ValueError, match=f"group_0 has {message}; pagedserve loads compressed-tensors"):
        load_model(folder, dtype=torch.float32, device=CPU, backend=backend("torch"))


def test_config_groups_of_another_shape_than_compressed_tensors_are_refused(tmp_path: Path) -> None:
    """A list where the format has a mapping used to stop the load with an AttributeError's traceback."""
    folder = compress_checkpoint(make_model("llama", tmp_path / "source"), tmp_path / "int8", "int8")
    config = json.loads((folder / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    for shape in (list(groups), {"group_0": ["Linear"]}):
        config["quantization_config"]["config_groups"] = shape
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelRefused, match="config_groups is not compressed-tensors' mapping"):
            load_model(folder, dtype=torch.float32, device=CPU, backend=backend("torch"))


def test_a_missing_or_misshapen_scale_is_refused(tmp_path: Path) -> None:
    folder = compress_checkpoint(make_model("llama", tmp_path / "source"), tmp_path / "int8", "int8")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    with safe_open(folder / "model.safetensors", framework="pt") as stored:
        tensors = {key: stored.get_tensor(key) for key in stored.keys()}  # noqa: SIM118
    scale = tensors.pop(name)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelRefused, match=name):
        load_model(folder, dtype=torch.float32, device=CPU, backend=backend("torch"))
    save_file({**tensors, name: scale[:-1]}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"a weight scale shaped \(63, 1\) fits neither 64 rows nor a tensor"
    ):
        load_model(folder, dtype=torch.float32, device=CPU, backend=backend("torch"))


@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        ("fp8", "model.layers.0.self_attn.q_proj.weight"),
        ("int8", "model.layers.1.mlp.down_proj.weight_scale"),
    ],
)
def test_a_stored_weight_or_scale_that_is_not_finite_is_refused(
    scheme: str, name: str, tmp_path: Path
) -> None:
    """A float8 weight's NaN byte (e4m3fn's 0x7f), or a NaN scale, would serve NaN logprobs and report
    SERVING: the load refuses it, naming the tensor and the dtype it is stored in."""
    folder = compress_checkpoint(make_model("llama", tmp_path / "source"), tmp_path / scheme, scheme)  # type: ignore[arg-type]
    with safe_open(folder / "model.safetensors", framework="pt") as stored:
        tensors = {key: stored.get_tensor(key) for key in stored.keys()}  # noqa: SIM118
    poisoned = tensors[name].clone()
    if poisoned.dtype == torch.float8_e4m3fn:
        poisoned.view(torch.uint8)[0, 0] = 0x7F
        dtype = "float8_e4m3fn"
    else:
        poisoned.view(-1)[0] = float("nan")
        dtype = "float32"
    save_file({**tensors, name: poisoned}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelRefused, match=f"{name} holds NaN or infinite values in {dtype}"):
        load_model(folder, dtype=torch.float32, device=CPU, backend=backend("torch"))


def next_token_logprobs(model: CausalLM, sequence: list[int], new: int) -> torch.Tensor:
    """Log-softmax of the model's logits at the last `new` positions of sequence, through the engine's
    prompt scoring: one prefill with every position's logits."""
    from scripts.eval_quantized import logits

    return logits(model, sequence)[-new - 1 : -1].float().log_softmax(-1)


def test_int8_smollm2_stays_close_to_float32() -> None:
    """The default model, teacher-forced on float32's greedy continuations of three chat prompts: int8's top
    token is float32's at most positions, and the next-token distributions are close (mean KL)."""
    from scripts.eval_quantized import PROMPTS, chat_prompts

    folder = default_model_dir()
    ops = backend("cpu")
    exact = load_model(folder, dtype=torch.float32, device=CPU, backend=ops)
    int8 = load_model(folder, dtype=torch.float32, device=CPU, backend=ops, quantization="int8")
    kv = LocalKVCache(exact.spec.pool_shape("float32", 16), 64)
    batch = chat_prompts(folder, PROMPTS[:3])
    continuations = run(EngineCore(exact, kv, EngineConfig()), batch)
    agree, kl, positions = 0, 0.0, 0
    for key, prompt in enumerate(batch):
        sequence = prompt + tokens(continuations[key])
        p = next_token_logprobs(exact, sequence, len(sequence) - len(prompt))
        q = next_token_logprobs(int8, sequence, len(sequence) - len(prompt))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float((p.exp() * (p - q)).sum())
        positions += p.shape[0]
    assert agree >= 0.9 * positions, f"int8's top token is float32's at {agree} of {positions} positions"
    assert kl / positions < 0.02, f"mean KL {kl / positions:.4f}"
