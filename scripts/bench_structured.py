"""The per-step cost of structured outputs against free generation, on SmolLM2-135M, fp32, on this machine.

    python scripts/bench_structured.py [--batches 1,32] [--output-tokens 48]

For each batch size, three engines on the same model run the same chat prompts, greedy, stepping in lockstep
so that they share the machine's noise: one free, and two with every request held to a JSON schema, which
fill the batch's token masks after the forward pass (`--no-overlap-grammar`) or while it runs (the default).
It prints the mean decode step (steps where the whole batch decodes) of each, the ratios to the free one, and
how long filling and applying the masks took in the engine that does it after the forward pass. Compare
ratios within one run: the machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

from services.common.default_model import default_model_dir  # noqa: E402
from services.common.request import EngineRequest  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.common.structured import Constraint  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.core import sampler  # noqa: E402
from services.worker.core.engine import EngineCore  # noqa: E402
from services.worker.core.engine_config import EngineConfig  # noqa: E402
from services.worker.core.grammar import Grammars  # noqa: E402
from services.worker.kv.local import LocalKVCache  # noqa: E402
from services.worker.models import CausalLM, load_model  # noqa: E402
from services.worker.server import kernel_backend  # noqa: E402

KV_BYTES = 256 * 2**20
# Long enough lists that a greedy answer keeps going for the steps measured.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2100},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 40},
    },
    "required": ["title", "year", "topics"],
    "additionalProperties": False,
}
QUESTION = "Describe a book about the history of printing as JSON, with its title, year and many topics."


class MaskTimer:
    """Wraps the sampler's mask_logits to add up the time it takes."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner: Callable[..., list[int]] = sampler.mask_logits
        sampler.mask_logits = self  # type: ignore[assignment]

    def __call__(self, logits: torch.Tensor, states: list, masks: torch.Tensor | None = None) -> list[int]:
        begin = time.perf_counter()
        try:
            return self._inner(logits, states, masks)
        finally:
            self.seconds += time.perf_counter() - begin


def engine(model: CausalLM, grammars: Grammars, page_size: int, overlap: bool) -> EngineCore:
    spec = model.spec
    shape = spec.pool_shape("float32", page_size)
    kv = LocalKVCache(shape, KV_BYTES // shape.page_bytes, model_id="bench", device=torch.device("cpu"))
    config = EngineConfig(prefix_caching=False, overlap_grammar=overlap)
    return EngineCore(model, kv, config, grammars=grammars)


def run(engines: dict[str, EngineCore], prompt: list[int], batch: int, tokens: int, timer: MaskTimer) -> dict:
    """The same requests on each engine, stepped in lockstep; returns each one's decode steps (s) and the
    constrained engine's mask time over those steps."""
    for name, core in engines.items():
        structured = Constraint("json_schema", json.dumps(SCHEMA)) if name != "free" else None
        options = SamplingOptions(max_tokens=tokens, temperature=0.0, structured=structured)
        for key in range(batch):
            core.add(core.new_sequence(key, EngineRequest(tuple(prompt), options)))
    steps: dict[str, list[float]] = {name: [] for name in engines}
    mask_s = 0.0
    while any(core.has_unfinished() for core in engines.values()):
        for name, core in engines.items():
            if not core.has_unfinished():
                continue
            masked_before, begin = timer.seconds, time.perf_counter()
            core.step()
            elapsed = time.perf_counter() - begin
            if core.last_batch == (batch, batch):  # every request decoding: a comparable step
                steps[name].append(elapsed)
                if name == "after":
                    mask_s += timer.seconds - masked_before
    return {"steps": steps, "mask_s": mask_s}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--output-tokens", type=int, default=48)
    args = parser.parse_args()
    config = WorkerConfig()
    folder = default_model_dir()
    model = load_model(
        folder,
        dtype=torch.float32,
        device=torch.device("cpu"),
        backend=kernel_backend(config, torch.device("cpu")),
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    grammars = Grammars(tokenizer, model.spec.vocab_size, model.spec.eos_token_ids)
    chat = [{"role": "user", "content": QUESTION}]
    prompt = list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    timer = MaskTimer()
    print(
        f"torch threads: {torch.get_num_threads()}, prompt: {len(prompt)} tokens, "
        f"output: {args.output_tokens} tokens, greedy"
    )
    print("| batch | free (ms) | masks after (ms) | ratio | masks overlapped (ms) | ratio | masks (ms) |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        engines = {
            "free": engine(model, grammars, config.page_size, overlap=False),
            "after": engine(model, grammars, config.page_size, overlap=False),
            "overlapped": engine(model, grammars, config.page_size, overlap=True),
        }
        result = run(engines, prompt, batch, args.output_tokens, timer)
        free, after, overlapped = (statistics.mean(result["steps"][name]) for name in engines)
        per_step = result["mask_s"] / len(result["steps"]["after"])
        print(
            f"| {batch} | {free * 1e3:.2f} | {after * 1e3:.2f} | {after / free:.3f} | {overlapped * 1e3:.2f} "
            f"| {overlapped / free:.3f} | {per_step * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
