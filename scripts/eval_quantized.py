"""How close a model in int8 (or bfloat16) stays to the same model in float32, on a fixed set of prompts.

    python scripts/eval_quantized.py [--model DIR] [--tokens 64] [--dtypes int8,int8-weight-only,bfloat16,...]

int8 is int8 weights with float32 activations, int8-bfloat16 the same weights with bfloat16 activations,
each rounded to int8 a row where the worker would (W8A8: on a CPU with AVX512-VNNI, and AVX512-BF16 for
bfloat16). int8-weight-only keeps float32 activations whole, as the worker does where VNNI does not run.
float32-kv-bfloat16 is the float32 model over a bfloat16 KV pool (--kv-cache-dtype bfloat16).

Each prompt is a chat message through the model's chat template. For each, the float32 model's greedy
continuation of --tokens tokens is the reference, and the other model is measured three ways:
- greedy agreement: the share of prompts whose greedy continuation is the reference, token for token, and
  the mean number of tokens it follows the reference before it first differs;
- teacher-forced top-1 agreement: fed the prompt and the reference, the share of the continuation's
  positions where its most likely next token is float32's;
- the mean KL divergence KL(float32 || other) of the next-token distributions over those positions.

All run the worker's own model code on the C++ CPU kernels, with the instructions the worker would use on
this CPU (pagedserve/kernels/cpu_features.py); the greedy continuations come from the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory_daemon.shape import DType  # noqa: E402
from pagedserve.kernels.backend import AttentionMetadata  # noqa: E402
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops  # noqa: E402
from pagedserve.kernels.cpu_features import Feature, cpu_features  # noqa: E402
from services.common.default_model import resolve_model  # noqa: E402
from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.worker.core.engine import EngineCore  # noqa: E402
from services.worker.core.engine_config import EngineConfig  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.models import CausalLM, load_model  # noqa: E402
from services.worker.models.quantized import int8_activations  # noqa: E402
from services.worker.quantization import Quantization  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain photosynthesis to a ten-year-old.",
    "What are three tips for staying focused while studying?",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is 17 multiplied by 23?",
    "Give me a short poem about the sea.",
    "How does a hash table work?",
    "What causes the seasons on Earth?",
    "List five animals that live in the Arctic.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "Suggest a name for a coffee shop.",
    "How do I make a cup of tea?",
    "What is machine learning?",
    "Describe the water cycle.",
    "What should I pack for a weekend camping trip?",
    "Tell me a fun fact about octopuses.",
]
PAGE_SIZE = 16
# What --dtypes names: the model's dtype (its activations), its weights' quantization and its pool's dtype.
VARIANTS: dict[str, tuple[torch.dtype, Quantization, torch.dtype | None]] = {
    "int8": (torch.float32, "int8", None),
    "int8-weight-only": (torch.float32, "int8", None),
    "bfloat16": (torch.bfloat16, "none", None),
    "int8-bfloat16": (torch.bfloat16, "int8", None),
    "float32-kv-bfloat16": (torch.float32, "none", torch.bfloat16),
}


def load(model_dir: Path, dtype: torch.dtype, quantization: Quantization, int8_rows: bool = True) -> CausalLM:
    """The model on the CPU kernels with what this CPU runs; without int8_rows, as if vpdpbusd did not."""
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the C++ CPU kernels could not be built here")
    found = cpu_features()
    if not int8_rows:
        found = dataclasses.replace(found, avx512_vnni=Feature("avx512_vnni", False, "withheld"))
    backend = CpuBackend(ops, found)
    return load_model(
        model_dir, dtype=dtype, device=torch.device("cpu"), backend=backend, quantization=quantization
    )


def pool_dtype(model: CausalLM, kv_dtype: torch.dtype | None) -> DType:
    return str(kv_dtype or model.dtype).removeprefix("torch.")  # type: ignore[return-value]


def greedy(
    model: CausalLM, prompts: list[list[int]], tokens: int, kv_dtype: torch.dtype | None = None
) -> list[list[int]]:
    """Each prompt's greedy continuation, through the engine, over a pool of kv_dtype (else the model's)."""
    kv = LocalKVCache(model.spec.pool_shape(pool_dtype(model, kv_dtype), PAGE_SIZE), 1024)
    engine = EngineCore(model, kv, EngineConfig(max_num_seqs=len(prompts)))
    options = SamplingOptions(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for key, prompt in enumerate(prompts):
        engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), options)))
    out: list[list[int]] = [[] for _ in prompts]
    for output in engine.run_until_done():
        out[output.key] += output.token_ids  # type: ignore[index]
    return out


def logits(model: CausalLM, tokens: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The model's next-token logits [len(tokens), V] at every position, from one prefill of tokens."""
    n = len(tokens)
    pages = -(-n // PAGE_SIZE)
    spec = model.spec
    assert spec.kv_groups.count == 1, "one group of layers: one block table"
    shape = spec.pool_shape(pool_dtype(model, kv_dtype), PAGE_SIZE)
    kv = torch.zeros(shape.tensor_shape(pages + 1), dtype=kv_dtype or model.dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n) + PAGE_SIZE,  # pages 1, 2, ...: page 0 is the null page
        block_tables=torch.arange(1, pages + 1)[None, :],
        seq_lens=torch.tensor([n]),
        query_start=torch.tensor([0, n]),
        num_decodes=0,
        seq_lens_host=(n,),
        query_start_host=(0, n),
        prefill_seq=torch.zeros(n, dtype=torch.int64),
        prefill_pos=torch.arange(n),
        decode_max_len=0,
    )
    ids = torch.tensor(tokens)
    return model.forward(ids, torch.arange(n), [meta], kv, torch.arange(n))


def chat_prompts(model_dir: Path, messages: list[str]) -> list[list[int]]:
    """Each message as a user's turn through the model's chat template, ready for the answer: token ids."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
        )
        for message in messages
    ]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtypes", default=",".join(VARIANTS), help="what to compare with float32")
    args = parser.parse_args()
    unknown = set(args.dtypes.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--dtypes takes {', '.join(VARIANTS)}, not {', '.join(sorted(unknown))}")
    model_dir = resolve_model(args.model)
    prompts = chat_prompts(model_dir, PROMPTS)
    reference_model = load(model_dir, torch.float32, "none")
    reference = greedy(reference_model, prompts, args.tokens)
    reference_logits = [
        logits(reference_model, p + r)[len(p) - 1 : -1].float()
        for p, r in zip(prompts, reference, strict=True)
    ]
    print(f"{len(PROMPTS)} prompts, {args.tokens} greedy tokens each, against float32 ({model_dir.name})\n")
    print("| model | same continuation | tokens before the first difference | top-1 agreement | mean KL |")
    print("|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype, quantization, kv_dtype = VARIANTS[name]
        model = load(model_dir, dtype, quantization, int8_rows=name != "int8-weight-only")
        continuations = greedy(model, prompts, args.tokens, kv_dtype)
        same = sum(c == r for c, r in zip(continuations, reference, strict=True))
        prefix = [
            next((i for i, (a, b) in enumerate(zip(c, r, strict=True)) if a != b), len(r))
            for c, r in zip(continuations, reference, strict=True)
        ]
        agree, kl, positions = 0, 0.0, 0
        for prompt, ref, expected in zip(prompts, reference, reference_logits, strict=True):
            actual = logits(model, prompt + ref, kv_dtype)[len(prompt) - 1 : -1].float()
            agree += int((actual.argmax(-1) == expected.argmax(-1)).sum())
            p, q = expected.log_softmax(-1), actual.log_softmax(-1)
            kl += float((p.exp() * (p - q)).sum())
            positions += len(ref)
        label = name
        if quantization == "int8":
            rounded = " rounded to int8 a row: W8A8" if int8_activations(model.weights) else ""
            label = f"int8 weights ({str(dtype).removeprefix('torch.')} activations{rounded})"
        print(
            f"| {label} | {same}/{len(prompts)} | {sum(prefix) / len(prefix):.1f} of {args.tokens} "
            f"| {agree / positions:.2%} | {kl / positions:.4f} |"
        )


if __name__ == "__main__":
    main()
