"""The engine on the CUDA kernels (CupyBackend), token for token as transformers, for the families whose
layers vary: Gemma 2 (windows, softcaps, a block table for each group of layers), gpt-oss (sinks, windows,
experts with biases and the clamped gate) and Qwen3-MoE (the experts' grouped GEMMs). Random models with a
head dim of 64, which the attention kernels take; prompts shorter and longer than the window, in one batch.

On a CUDA device with CuPy, else in the kernels' emulator on the CPU (then in float32 only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.kernels.cupy_backend import CupyBackend
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineCore
from services.worker.core.engine_config import EngineConfig
from services.worker.kv.local import LocalKVCache
from services.worker.models import load_model
from tests.kernels.cases import DEVICE
from tests.models import VOCAB, make_model
from tests.pages import assert_pages_back

pytestmark = pytest.mark.cuda_kernels  # on a GPU, else in the emulator on the CPU: tests/devices.py

NEW_TOKENS = 8
SHAPE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}


@pytest.mark.parametrize("family", ["gemma2-softcap", "gpt-oss", "qwen3-moe"])
def test_the_engine_on_the_cuda_kernels_agrees_with_transformers(
    backend: CupyBackend, family: str, tmp_path: Path
) -> None:
    folder = make_model(family, tmp_path, **SHAPE)
    model = load_model(folder, dtype=torch.float32, device=DEVICE, backend=backend)
    kv = LocalKVCache(model.spec.pool_shape("float32", 16), 64, device=DEVICE)
    engine = EngineCore(model, kv, EngineConfig(max_batched_tokens=64, max_num_seqs=4))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (9, 40)]
    options = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for key, prompt in enumerate(prompts):
        engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), options)))
    produced: dict[object, list[int]] = {}
    for output in engine.run_until_done():
        produced.setdefault(output.key, []).extend(output.token_ids)

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    for key, prompt in enumerate(prompts):
        expected = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        assert produced[key] == expected, f"prompt {key} ({len(prompt)} tokens)"
    assert_pages_back(kv)
