"""SMG's vLLM protocol at the frontend's edge: its GenerateRequest, and the detokenizing its requests do.

Sections: requests (each sampling field with vLLM's meaning, n, structured outputs, logit bias, min_tokens
and prompt logprobs included, and every field pagedserve does not do refused by name, never dropped); and
detokenizing (the protocol sends token ids alone, since the gateway detokenizes, so a request of it decodes
text only to find its stop strings: one without stop strings never calls the detokenizer, nor looks up its
top logprobs' text).

The detokenizing tests run the servicer on the frontend's real pipeline (builder, admission, tokenizer
threads) over the SmolLM2 tokenizer, wrapped to count the calls that turn ids into text; one fake worker
answers every request.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument, StatusError, Unimplemented
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.worker.v1 import worker_pb2
from services.common.request import EngineRequest, ModelLimits
from services.common.structured import Constraint
from services.common.wire import sampling_from_pb
from services.frontend.admission import Admission
from services.frontend.generation import RequestPipeline
from services.frontend.identity import ClientIdentity
from services.frontend.validation import RequestBuilder
from services.frontend.vllm_request import request_of
from services.frontend.vllm_service import VllmEngineService

# Requests -------------------------------------------------------------------------------------------------

KV_TRANSFER = vllm_engine_pb2.KvTransferParams(remote_port=1)


def request(**sampling: object) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id="r1",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vllm_engine_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def test_sampling_fields_keep_their_vllm_meanings() -> None:
    sample = request_of(
        request(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            repetition_penalty=1.2,
            max_tokens=17,
            stop=["\n\n"],
            stop_token_ids=[2],
            ignore_eos=True,
            logprobs=3,
            seed=11,
            skip_special_tokens=True,  # the gateway detokenizes: no token changes
            include_stop_str_in_output=True,
            min_tokens=2,
            n=3,
            prompt_logprobs=0,
            logit_bias={5: 10.0, 9: -100.0},
        )
    )
    assert list(sample.prompt_token_ids) == [5, 6, 7] and sample.request_id == "r1"
    s = sample.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == pytest.approx((0.7, 0.9, 40, 0.05))
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == pytest.approx((0.5, -0.5, 1.2))
    assert (s.max_tokens, list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (17, ["\n\n"], [2], True)
    assert (s.logprobs, s.seed, s.min_tokens, s.n, s.prompt_logprobs) == (3, 11, 2, 3, 0)
    assert dict(s.logit_bias) == {5: 10.0, 9: -100.0}


def test_proto3_zeros_take_vllms_defaults() -> None:
    s = request_of(request()).sampling
    assert not s.HasField("temperature") and not s.HasField("max_tokens") and not s.HasField("seed")
    assert not s.HasField("prompt_logprobs") and not s.HasField("structured")
    assert (s.top_p, s.repetition_penalty, s.top_k, s.n, s.min_tokens) == (1.0, 1.0, 0, 1, 0)


def test_text_input_becomes_the_prompt() -> None:
    sample = request_of(vllm_engine_pb2.GenerateRequest(request_id="t", text="Hello"))
    assert sample.prompt == "Hello" and not sample.prompt_token_ids


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("json_schema", '{"type": "object"}', Constraint("json_schema", '{"type": "object"}')),
        ("json_object", True, Constraint("json_object")),
        ("regex", "a+", Constraint("regex", "a+")),
        ("grammar", 'root ::= "x"', Constraint("grammar", 'root ::= "x"')),
        (
            "choice",
            vllm_engine_pb2.ChoiceConstraint(choices=["a", "b"]),
            Constraint("choice", choices=("a", "b")),
        ),
    ],
)
def test_each_structured_output_becomes_pagedserves_constraint(
    field: str, value: object, expected: Constraint
) -> None:
    sampling = request_of(request(**{field: value})).sampling
    assert sampling_from_pb(sampling).structured == expected


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("structural_tag", "{}", "structural tags"),
        ("truncate_prompt_tokens", 8, "prompt truncation (truncate_prompt_tokens)"),
    ],
)
def test_what_pagedserve_does_not_do_is_unimplemented_by_name(field: str, value: object, words: str) -> None:
    with pytest.raises(Unimplemented, match="^" + re.escape(words)):
        request_of(request(**{field: value}))


@pytest.mark.parametrize(
    ("change", "kind", "words"),
    [
        ({"mm_inputs": vllm_engine_pb2.MultimodalInputs(mm_hashes=["h"])}, Unimplemented, "multimodal"),
        (
            {"extra_mm_inputs": [vllm_engine_pb2.MultimodalInputs(mm_hashes=["h"])]},
            Unimplemented,
            "multimodal",
        ),
        ({"media_refs": vllm_engine_pb2.MediaRefs()}, Unimplemented, "multimodal"),
        ({"kv_transfer_params_json": "{}"}, Unimplemented, "KV transfer"),
        (
            {"kv_transfer_params": vllm_engine_pb2.KvTransferParams(remote_port=1)},
            Unimplemented,
            "KV transfer",
        ),
        ({"data_parallel_rank": 1}, InvalidArgument, "rank 0 only"),
    ],
)
def test_requests_pagedserve_cannot_serve_are_refused(
    change: dict[str, object], kind: type[StatusError], words: str
) -> None:
    bad = request()
    bad.MergeFrom(vllm_engine_pb2.GenerateRequest(**change))  # type: ignore[arg-type]
    with pytest.raises(kind, match=words):
        request_of(bad)


def test_a_request_without_input_or_with_every_logprob_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="no input"):
        request_of(vllm_engine_pb2.GenerateRequest(request_id="x"))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidArgument, match=f"{field} is -1 .all.; at most 20"):
            request_of(request(**{field: -1}))
    with pytest.raises(InvalidArgument, match="token id -3, which is negative"):
        request_of(request(logit_bias={-3: 1.0}))


def test_common_proto_is_the_package_one() -> None:
    """The gateway's shared messages come from smg-grpc-proto, not from a copy of ours."""
    assert common_pb2.DESCRIPTOR.package == "smg.grpc.common"


# Detokenizing ---------------------------------------------------------------------------------------------

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
