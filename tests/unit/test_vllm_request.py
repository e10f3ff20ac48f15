"""SMG's vLLM GenerateRequest at the frontend's edge: each sampling field with vLLM's meaning (n, structured
outputs, logit bias, min_tokens and prompt logprobs included), and every field pagedserve does not do refused
by name, never dropped."""

from __future__ import annotations

import re

import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from pagedserve.plumbing.errors import InvalidArgument, StatusError, Unimplemented
from services.common.structured import Constraint
from services.common.wire import sampling_from_pb
from services.frontend.vllm_request import request_of

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
    for name, value in change.items():
        if isinstance(value, str | int):
            setattr(bad, name, value)
        else:
            getattr(bad, name).CopyFrom(value)
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
