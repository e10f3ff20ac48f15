"""The KV pages a long sequence holds on a model whose every layer slides, with the pages before the window
given back (the engine's way) and kept (as before): one random Mistral-shaped model, one sequence.

    python scripts/bench_window_pages.py [--window 1024] [--tokens 4096] [--output-tokens 64]

It prints the pages the sequence holds at its largest while it decodes, and at the end, for both.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MistralConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.cpu_backend import CpuBackend, cpu_ops  # noqa: E402
from kernels.torch_ref import TorchBackend  # noqa: E402
from memory_daemon.shape import PoolShape  # noqa: E402
from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.worker.core.engine import EngineConfig, EngineCore  # noqa: E402
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096, help="the sequence's length at its end")
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    config = MistralConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * args.tokens, sliding_window=args.window,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="ps-window-"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    ops = cpu_ops()
    backend = CpuBackend(ops) if ops is not None else TorchBackend()
    model = load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=backend)
    spec = model.spec
    prompt = torch.randint(3, 512, (args.tokens - args.output_tokens,)).tolist()
    print(f"every layer slides over {args.window} tokens; one sequence of {len(prompt)} prompt tokens and "
          f"{args.output_tokens} output tokens, pages of {PAGE}, {backend.name} kernels")  # fmt: skip
    results = {}
    for name in ("given back", "kept"):
        kv = LocalKVCache(PoolShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", PAGE), 512)
        engine = EngineCore(model, kv, EngineConfig(max_batched_tokens=512, prefix_caching=False))
        if name == "kept":
            engine.scheduler.reach = 0
        results[name] = held_pages(engine, prompt, args.output_tokens)
    print(f"\n{'pages before the window':<24} {'most held decoding':>19} {'held at the end':>16}")
    for name, (most, last, _) in results.items():
        print(f"{name:<24} {most:>19} {last:>16}")
    same = results["given back"][2] == results["kept"][2]
    print(f"\nthe same tokens either way: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
