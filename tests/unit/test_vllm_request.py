"""SMG's vLLM GenerateRequest at the frontend's edge: each sampling field with vLLM's meaning, one request per
sample of n, and every field pagedserve does not do refused by name, never dropped."""

from __future__ import annotations

import re

import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from pagedserve.plumbing.errors import InvalidArgument, StatusError, Unimplemented
from services.frontend.vllm_request import MAX_SAMPLES, samples

KV_TRANSFER = vllm_engine_pb2.KvTransferParams(remote_port=1)


def request(**sampling: object) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id="r1",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vllm_engine_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def test_sampling_fields_keep_their_vllm_meanings() -> None:
    (sample,) = samples(
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
        )
    )
    assert list(sample.prompt_token_ids) == [5, 6, 7] and sample.request_id == "r1"
    s = sample.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == pytest.approx((0.7, 0.9, 40, 0.05))
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == pytest.approx((0.5, -0.5, 1.2))
    assert (s.max_tokens, list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (17, ["\n\n"], [2], True)
    assert (s.logprobs, s.seed) == (3, 11)


def test_proto3_zeros_take_vllms_defaults() -> None:
    (sample,) = samples(request())
    s = sample.sampling
    assert not s.HasField("temperature") and not s.HasField("max_tokens") and not s.HasField("seed")
    assert (s.top_p, s.repetition_penalty, s.top_k) == (1.0, 1.0, 0)


def test_text_input_becomes_the_prompt() -> None:
    (sample,) = samples(vllm_engine_pb2.GenerateRequest(request_id="t", text="Hello"))
    assert sample.prompt == "Hello" and not sample.prompt_token_ids


def test_n_samples_are_n_requests_each_with_its_own_seed() -> None:
    many = samples(request(n=3, seed=7, temperature=1.0))
    assert [s.sampling.seed for s in many] == [7, 8, 9]
    assert all(list(s.prompt_token_ids) == [5, 6, 7] for s in many)
    assert all(not s.sampling.HasField("seed") for s in samples(request(n=2)))
    with pytest.raises(InvalidArgument, match=f"at most {MAX_SAMPLES}"):
        samples(request(n=MAX_SAMPLES + 1))


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("json_schema", '{"type": "object"}', "structured outputs (json_schema)"),
        ("regex", "a+", "structured outputs (regex)"),
        ("choice", vllm_engine_pb2.ChoiceConstraint(choices=["a"]), "structured outputs (choice)"),
        ("prompt_logprobs", 1, "prompt logprobs"),
        ("truncate_prompt_tokens", 8, "prompt truncation (truncate_prompt_tokens)"),
        ("logit_bias", {5: 10.0}, "logit_bias"),
        ("min_tokens", 4, "min_tokens (4) is supported only with ignore_eos"),
    ],
)
def test_what_pagedserve_does_not_do_is_unimplemented_by_name(field: str, value: object, words: str) -> None:
    with pytest.raises(Unimplemented, match="^" + re.escape(words)):
        samples(request(**{field: value}))


def test_min_tokens_is_taken_where_nothing_could_stop_the_request_early() -> None:
    (sample,) = samples(request(min_tokens=8, max_tokens=8, ignore_eos=True))
    assert sample.sampling.max_tokens == 8


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
        samples(bad)


def test_a_request_without_input_or_with_every_logprob_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="no input"):
        samples(vllm_engine_pb2.GenerateRequest(request_id="x"))
    with pytest.raises(InvalidArgument, match="at most 20"):
        samples(request(logprobs=-1))


def test_common_proto_is_the_package_one() -> None:
    """The gateway's shared messages come from smg-grpc-proto, not from a copy of ours."""
    assert common_pb2.DESCRIPTOR.package == "smg.grpc.common"
