"""The engine in bfloat16 against transformers in bfloat16, for every family on each CPU backend.

Two bfloat16 implementations round at different points (the C++ ops sum in float32 and round once where
transformers rounds each op), so their logits differ by a few of bfloat16's steps and a near-tie may go
either way. The engine's greedy tokens are checked by teacher forcing: transformers runs the prompt and the
engine's continuation in one pass, and at each position the engine's token must be transformers' top
token, or as close to it as the two may differ: TIE_STEPS steps of bfloat16 at the logits' scale, and
twice as far as transformers' own bfloat16 logits of the two tokens lie from its float32 ones. A mixture
of experts' routing is a choice among experts too: where transformers' router has a tie at that
resolution between the last expert it picks and the next, the two may route differently and the position
is not judged. A log-probability agrees within LOGPROB_STEPS such steps and twice transformers' own error
at that token; and on average over a run, the engine's log-probabilities lie no further from float32's
than MEAN_ERROR_RATIO times transformers' bfloat16 ones do (measured: at most 1.2 times, on an AMD EPYC
with AVX2), so that an error in every position, each within its own tolerance, still fails.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineCore
from services.worker.core.engine_config import EngineConfig
from services.worker.kv.local import LocalKVCache
from services.worker.models import load_model
from tests.models import FAMILIES, make_model
from tests.pages import assert_pages_back
from tests.unit.test_engine import backend, prompts

BF16 = torch.bfloat16
NEW_TOKENS = 16
TIE_STEPS = 4  # of bfloat16 at the logits' scale (the largest magnitude in the row): 2^-7 of its power of two
LOGPROB_STEPS = 8
MEAN_ERROR_RATIO = 1.5
MIN_EXACT = 0.85  # of all positions: ties are the exception


def step_of(value: float) -> float:
    """The distance between neighbouring bfloat16 values around value (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 2**-20))) - 7)


def router_ties(hf: PreTrainedModel, tokens: list[int]) -> set[int]:
    """Positions where some layer's router (a module named ...gate or ...router, with a weight) has a tie
    at bfloat16's resolution between the top_k-th and the next expert."""
    config = hf.config
    top_k = getattr(config, "num_experts_per_tok", 0)
    routers = [
        m for n, m in hf.named_modules() if n.endswith(("mlp.gate", "mlp.router")) and hasattr(m, "weight")
    ]
    if not top_k or not routers:
        return set()
    inputs: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, args, out: inputs.append(args[0])) for r in routers]
    with torch.no_grad():
        hf(torch.tensor([tokens]))
        tied = set()
        for router, hidden in zip(routers, inputs, strict=True):
            logits = F.linear(
                hidden.reshape(-1, hidden.shape[-1]), router.weight, getattr(router, "bias", None)
            )
            ranked = logits.float().sort(dim=-1, descending=True).values
            for position, row in enumerate(ranked):
                last, next_ = row[top_k - 1].item(), row[top_k].item()
                if last - next_ <= TIE_STEPS * step_of(last):
                    tied.add(position)
    for hook in hooks:
        hook.remove()
    return tied


# Head sizes the C++ decode attention has its own code for (64, 128; the families' models have 16 or 32):
# 3 query heads a KV head, as SmolLM2's, or 2; with softcaps and windows.
HEAD_SIZES = {
    "llama-d64": (
        "llama",
        {"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64},
    ),
    "llama-d128": ("llama", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}),
    "gemma2-softcap-d64": ("gemma2-softcap", {"head_dim": 64}),
    "mistral-window-d128": ("mistral-window", {"head_dim": 128}),
}


@pytest.mark.parametrize("kernels", ["torch", "cpu", "cpu-worker"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_and_logprobs_agree_within_bfloat16(name: str, kernels: str, tmp_path: Path) -> None:
    assert_agreement(make_model(name, tmp_path), kernels)


@pytest.mark.parametrize("kernels", ["cpu", "cpu-worker"])
@pytest.mark.parametrize("shape", HEAD_SIZES)
def test_head_sizes_with_their_own_kernels_agree_within_bfloat16(
    shape: str, kernels: str, tmp_path: Path
) -> None:
    family, overrides = HEAD_SIZES[shape]
    assert_agreement(make_model(family, tmp_path, **overrides), kernels)


def assert_agreement(folder: Path, kernels: str) -> None:
    """The engine's greedy tokens and log-probabilities through these kernels, on the model in folder,
    against transformers' in bfloat16, as the module's docstring says."""
    model = load_model(folder, dtype=BF16, device=torch.device("cpu"), backend=backend(kernels))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=BF16, attn_implementation="eager").eval()
    hf32 = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    kv = LocalKVCache(model.spec.pool_shape("bfloat16", 16), 256)
    assert kv.kv.dtype == BF16
    engine = EngineCore(model, kv, EngineConfig(max_batched_tokens=32, max_num_seqs=16))
    batch = prompts(5, 30, 70, seed=10)  # 70 > the budget of 32: chunked, beside decodes
    options = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    for key, prompt in enumerate(batch):
        engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), options)))
    tokens: dict[int, list[int]] = {key: [] for key in range(len(batch))}
    logprobs: dict[int, list[float]] = {key: [] for key in range(len(batch))}
    for output in engine.run_until_done():
        tokens[output.key] += output.token_ids  # type: ignore[index]
        logprobs[output.key] += [lp.logprob for lp in output.logprobs]  # type: ignore[index]
    assert_pages_back(engine.kv)

    exact, judged = 0, 0
    errors, own_errors = [], []  # the engine's and transformers' bf16 log-probabilities against float32's
    for key, prompt in enumerate(batch):
        sequence = prompt + tokens[key]
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0, len(prompt) - 1 : -1].float()
            exact_logits = hf32(torch.tensor([sequence])).logits[0, len(prompt) - 1 : -1]
        own_error = (logits - exact_logits).abs()  # transformers' bfloat16 against its float32
        own_logprobs, exact_logprobs = logits.log_softmax(-1), exact_logits.log_softmax(-1)
        tied_routes = router_ties(hf, sequence)
        assert len(tokens[key]) == NEW_TOKENS
        for step, token in enumerate(tokens[key]):
            if len(prompt) - 1 + step in tied_routes:
                continue
            judged += 1
            row = logits[step]
            resolution = step_of(row.abs().max().item())
            top = int(row.argmax().item())
            exact += int(top == token)
            gap = row[top].item() - row[token].item()
            tie = TIE_STEPS * resolution + 2 * (own_error[step, top] + own_error[step, token]).item()
            assert gap <= tie, (
                f"prompt {key} step {step}: {token} is {gap:.4f} below the top (a tie: {tie:.4f})"
            )
            expected, exact_logprob = own_logprobs[step, token].item(), exact_logprobs[step, token].item()
            own = abs(expected - exact_logprob)
            assert abs(logprobs[key][step] - expected) <= LOGPROB_STEPS * resolution + 2 * own
            errors.append(abs(logprobs[key][step] - exact_logprob))
            own_errors.append(own)
    mean_error, own_mean = sum(errors) / len(errors), sum(own_errors) / len(own_errors)
    assert mean_error <= MEAN_ERROR_RATIO * own_mean, (
        f"the engine's log-probabilities lie {mean_error:.4f} from float32's on average; transformers' "
        f"bfloat16 ones {own_mean:.4f}"
    )
    assert exact >= MIN_EXACT * judged, f"{exact} of {judged} positions take transformers' top token"
