"""The KV a long sequence holds on sliding-window models, with the pages before each window given back (the
engine's way) and kept (as before): a random Mistral-shaped model whose every layer slides, and a random
Gemma 2-shaped one whose layers alternate between sliding and full attention (a block table for each group
of layers, services.worker.kv.groups); one sequence each.

    python scripts/bench_window_pages.py [--window 1024] [--tokens 4096] [--output-tokens 64]

It prints the pages the sequence holds at its largest while it decodes, and at the end, and their bytes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig, PretrainedConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops  # noqa: E402
from pagedserve.kernels.torch_ref import TorchBackend  # noqa: E402
from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.worker.core.engine import EngineCore  # noqa: E402
from services.worker.core.engine_config import EngineConfig  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.models import load_model  # noqa: E402

PAGE = 16


def held_pages(engine: EngineCore, prompt: list[int], out_len: int) -> tuple[int, int, list[int]]:
    """Run one greedy sequence; (the most pages it held while decoding, the pages held at its last step,
    its tokens)."""
    options = SamplingOptions(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    engine.add(engine.new_sequence(0, EngineRequest(tuple(prompt), options)))
    held, produced = [], []
    while engine.has_unfinished():
        produced += [token for output in engine.step() for token in output.token_ids]
        held += [len(seq.held_pages) for seq in engine.scheduler.running if seq.num_computed > len(prompt)]
    return max(held), held[-1], produced


def configs(window: int, positions: int) -> dict[str, PretrainedConfig]:
    common: dict[str, Any] = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=positions, sliding_window=window,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    alternating = ["sliding_attention", "full_attention"] * 2
    return {
        "every layer slides": MistralConfig(**common),
        "sliding and full layers": Gemma2Config(**common, layer_types=alternating, query_pre_attn_scalar=64),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096, help="the sequence's length at its end")
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    ops = cpu_ops()
    backend = CpuBackend(ops) if ops is not None else TorchBackend()
    prompt_len = args.tokens - args.output_tokens
    print(f"windows of {args.window} tokens; one sequence of {prompt_len} prompt tokens and "
          f"{args.output_tokens} output tokens, pages of {PAGE} tokens, {backend.name} kernels")  # fmt: skip
    print(f"\n{'model':<24} {'pages before windows':<21} {'most held decoding':>19} {'at end':>7} {'MiB':>6}")
    same = True
    for model_name, config in configs(args.window, 2 * args.tokens).items():
        folder = Path(tempfile.mkdtemp(prefix="ps-window-"))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        model = load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=backend)
        spec = model.spec
        shape = spec.pool_shape("float32", PAGE)
        prompt = torch.randint(3, 512, (prompt_len,)).tolist()
        produced = []
        for name in ("given back", "kept"):
            kv = LocalKVCache(shape, 1024)
            engine = EngineCore(model, kv, EngineConfig(max_batched_tokens=512, prefix_caching=False))
            if name == "kept":
                engine.scheduler.windows = (0,) * spec.kv_groups.count
            most, last, tokens = held_pages(engine, prompt, args.output_tokens)
            produced.append(tokens)
            mib = most * shape.page_bytes / 2**20
            print(f"{model_name:<24} {name:<21} {most:>19} {last:>7} {mib:>6.1f}")
        same = same and produced[0] == produced[1]
    print(f"\nthe same tokens either way: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
