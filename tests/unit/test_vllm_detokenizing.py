"""SMG's vLLM protocol sends token ids alone (the gateway detokenizes), so a request of it decodes text only
to find its stop strings: one without stop strings never calls the detokenizer, nor looks up its top
logprobs' text.

The servicer runs on the frontend's real pipeline (builder, admission, tokenizer threads) over the SmolLM2
tokenizer, wrapped to count the calls that turn ids into text; one fake worker answers every request.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2
from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.worker.v1 import worker_pb2
from services.common.request import EngineRequest, ModelLimits
from services.frontend.admission import Admission
from services.frontend.generation import RequestPipeline
from services.frontend.identity import ClientIdentity
from services.frontend.validation import RequestBuilder
from services.frontend.vllm_service import VllmEngineService

PROMPT = "The capital of France is"
ANSWER = " Paris, the city of light."


class CountingTokenizer:
    """The frontend's tokenizer, counting the calls that turn ids into text: decode and
    convert_ids_to_tokens, and each reach for the backend tokenizer, which the detokenizer (`TextStream`)
    decodes with (a Rust object that no wrapper can stand in for)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    @property
    def backend_tokenizer(self) -> Any:
        self.calls += 1
        return self._tokenizer.backend_tokenizer

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._tokenizer.decode(*args, **kwargs)

    def convert_ids_to_tokens(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._tokenizer.convert_ids_to_tokens(*args, **kwargs)


class OneWorker:
    """A router with one worker, which answers every request with the same tokens, one an output, each with
    its top logprobs, and LENGTH on the last."""

    accepting = True

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.aborted: list[str] = []

    def limits(self) -> ModelLimits:
        return ModelLimits(vocab_size=49152, max_model_len=8192)

    def pick(self) -> OneWorker:
        return self

    def submit(self, request: EngineRequest) -> tuple[str, asyncio.Queue[worker_pb2.RequestOutput]]:
        outputs: asyncio.Queue[worker_pb2.RequestOutput] = asyncio.Queue()
        for i, token in enumerate(self.token_ids):
            top = [
                pb.TopLogprob(token_id=token, logprob=-0.5),
                pb.TopLogprob(token_id=token + 1, logprob=-1.5),
            ]
            last = i == len(self.token_ids) - 1
            outputs.put_nowait(
                worker_pb2.RequestOutput(
                    request_id="0",
                    token_ids=[token],
                    logprobs=[pb.TokenLogprobs(token_id=token, logprob=-0.5, top=top)],
                    finish_reason=pb.GenerateResponse.LENGTH if last else 0,
                )
            )
        return "0", outputs

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class Context:
    """A servicer's context that keeps what the servicer writes."""

    def __init__(self) -> None:
        self.written: list[vllm_engine_pb2.GenerateResponse] = []

    async def write(self, message: vllm_engine_pb2.GenerateResponse) -> None:
        self.written.append(message)

    def peer(self) -> str:
        return "unix:/tmp/frontend.sock"

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None


@pytest.fixture
def counting(frontend_tokenizer: PreTrainedTokenizerBase) -> CountingTokenizer:
    return CountingTokenizer(frontend_tokenizer)


def generate(
    counting: CountingTokenizer, stop: list[str]
) -> tuple[list[vllm_engine_pb2.GenerateResponse], OneWorker]:
    """Answer a streamed vLLM request with logprobs through the servicer: what it wrote, and the worker."""
    builder = RequestBuilder(counting, default_max_tokens=16)  # type: ignore[arg-type]
    prompt_ids = counting(PROMPT)["input_ids"]
    worker = OneWorker(counting(PROMPT + ANSWER)["input_ids"][len(prompt_ids) :])
    counting.calls = 0  # what setting up called
    request = vllm_engine_pb2.GenerateRequest(
        request_id="r",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt_ids),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=16, logprobs=2, stop=stop),
        stream=True,
    )
    context = Context()

    async def serve() -> None:
        with ThreadPoolExecutor(1) as tokenizing:
            clients = ClientIdentity(())
            pipeline = RequestPipeline(worker, Admission(4, 4), builder, tokenizing, clients)  # type: ignore[arg-type]
            service = VllmEngineService(pipeline, None, None, 5.0, gateway=False)  # type: ignore[arg-type]
            await service.Generate(request, context)  # type: ignore[arg-type]

    asyncio.run(serve())
    return context.written, worker


def test_a_request_without_stop_strings_never_decodes(counting: CountingTokenizer) -> None:
    written, worker = generate(counting, stop=[])
    assert counting.calls == 0
    *chunks, last = written
    assert [token for chunk in chunks for token in chunk.chunk.token_ids] == worker.token_ids
    assert last.complete.finish_reason == "length"
    tops = [chunk.chunk.output_logprobs.top_logprobs[0] for chunk in chunks]
    assert all(len(top.token_ids) == 2 for top in tops)  # the top logprobs are there, as ids


def test_a_request_with_stop_strings_decodes_to_find_them(counting: CountingTokenizer) -> None:
    written, worker = generate(counting, stop=[", the"])
    assert counting.calls > 0
    complete = written[-1].complete
    assert (complete.finish_reason, complete.matched_stop_str) == ("stop", ", the")
    assert worker.aborted == ["0"]  # the frontend found the stop string: the worker need not go on
    assert len(written) - 1 < len(worker.token_ids)  # the tokens after it were not sent
