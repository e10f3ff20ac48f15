"""A request's output, bit for bit, whatever runs beside it, however its prompt is chunked, and (where the
model computes in bfloat16 on vdpbf16ps) after a failover that recomputes some of its tokens, on the C++ CPU
kernels with the instructions the worker uses here: every GEMM gives a row the same bits at any number of
rows, and a bfloat16 decode's attention is what the prefill computes for the same token (attention_steps.h).
The default model, greedy with log-probabilities, on chat prompts."""

from __future__ import annotations

from collections import defaultdict

import torch

from pagedserve.kernels.cpu_features import cpu_features
from scripts.eval_quantized import PROMPTS, chat_prompts
from services.common.default_model import default_model_dir
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineCore
from services.worker.core.engine_config import EngineConfig
from services.worker.core.sequence import TokenLogprob
from services.worker.kv.local import LocalKVCache
from services.worker.models import CausalLM, load_model
from tests.pages import assert_pages_back
from tests.unit.test_engine import backend

NEW_TOKENS = 40
OPTIONS = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


def bfloat16_decodes_as_prefills() -> bool:
    """Whether a bfloat16 model's decodes here compute what its prefills do: vdpbf16ps runs, and AMX's tiles
    (the prefill's products where they run, and oneDNN's bfloat16 GEMMs) do not."""
    found = cpu_features()
    return found.avx512_bf16.usable and not found.amx_bf16.usable


def model(dtype: torch.dtype) -> CausalLM:
    kernels = backend("cpu-worker")  # the instructions the worker uses here
    return load_model(default_model_dir(), dtype=dtype, device=torch.device("cpu"), backend=kernels)


Output = tuple[list[int], list[TokenLogprob]]


def generate(
    lm: CausalLM, requests: list[EngineRequest], max_batched_tokens: int = 2048
) -> dict[int, Output]:
    """Each request's tokens and log-probabilities (with their top two), run together on a fresh pool."""
    kv = LocalKVCache(lm.spec.pool_shape("bfloat16" if lm.dtype == torch.bfloat16 else "float32", 16), 400)
    engine = EngineCore(lm, kv, EngineConfig(max_batched_tokens=max_batched_tokens, max_num_seqs=32))
    for key, request in enumerate(requests):
        engine.add(engine.new_sequence(key, request))
    outputs: dict[int, Output] = defaultdict(lambda: ([], []))
    for output in engine.run_until_done():
        tokens, logprobs = outputs[output.key]  # type: ignore[index]
        tokens += output.token_ids
        logprobs += output.logprobs
    assert_pages_back(engine.kv)
    return outputs


def dtypes_here() -> list[torch.dtype]:
    return [torch.float32] + ([torch.bfloat16] if bfloat16_decodes_as_prefills() else [])


def test_a_request_gives_the_same_bits_alone_and_among_others() -> None:
    """One chat prompt alone, then beside 19 others whose prompts the step's budget of 64 tokens chunks
    (its own too), so that its steps mix prefill chunks with decodes and run past 16 rows: the same tokens,
    and the same log-probabilities to the last bit, in float32 on any CPU and in bfloat16 where it decodes
    as it prefills."""
    folder = default_model_dir()
    prompts = chat_prompts(folder, PROMPTS * 2)[:20]
    for dtype in dtypes_here():
        lm = model(dtype)
        (alone,) = generate(lm, [EngineRequest(tuple(prompts[0]), OPTIONS)]).values()
        together = generate(lm, [EngineRequest(tuple(p), OPTIONS) for p in prompts], max_batched_tokens=64)
        assert len(alone[0]) == NEW_TOKENS
        assert together[0] == alone, dtype


def test_a_resumed_bfloat16_request_goes_on_with_the_bits_of_one_never_interrupted() -> None:
    """A failover resubmits a request with the tokens it streamed (EngineRequest.generated), and the new
    worker recomputes the KV of those not in the prefix cache in one prefill, where the first worker decoded
    them one at a time. Where a bfloat16 model decodes as it prefills, the rest comes out as the
    uninterrupted run's, bit for bit: resumed after 21 tokens (mid-page) and after 32 (a page's end).
    Elsewhere its decodes sum in another order, and only greedy agreement is claimed (the failover test)."""
    if not bfloat16_decodes_as_prefills():
        assert torch.float32 in dtypes_here()  # the float32 batch property holds; resumes are not bitwise
        return
    lm = model(torch.bfloat16)
    prompt = tuple(chat_prompts(default_model_dir(), PROMPTS[2:3])[0])
    (whole,) = generate(lm, [EngineRequest(prompt, OPTIONS)]).values()
    for streamed in (21, 32):
        request = EngineRequest(prompt, OPTIONS, generated=tuple(whole[0][:streamed]))
        (resumed,) = generate(lm, [request]).values()
        assert resumed == (whole[0][streamed:], whole[1][streamed:]), streamed
