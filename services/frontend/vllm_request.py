"""SMG's vLLM worker protocol at the edge: a `vllm.grpc.engine.GenerateRequest` as pagedserve's own request.

The gateway tokenizes and detokenizes itself, so a request arrives as token ids (or text) with vLLM's
sampling parameters, and what goes back is token ids. Each field is either given its vLLM meaning here or
refused by name: multimodal inputs, KV transfer, structural tags and prompt truncation get UNIMPLEMENTED,
never silent neglect. Fields that only shape the gateway's own detokenization (skip_special_tokens,
spaces_between_special_tokens, include_stop_str_in_output) change no token, so they are the gateway's to
apply; grammar_from_first_token changes nothing either, since pagedserve runs no reasoning parser and a
constraint always starts at the first generated token. The checks that the converted request then meets
name pagedserve's fields; their refusals go back naming vLLM's (`in_vllm_terms`).
"""

from __future__ import annotations

import re

from smg_grpc_proto.generated import vllm_engine_pb2

from pagedserve.plumbing.errors import InvalidArgument, StatusError, Unimplemented
from pagedserve.v1 import generation_pb2
from services.common.sampling import MAX_LOGPROBS

# vLLM's unsigned fields that are pagedserve's signed ones: a value past int32's range fits no limit.
_UINT32_TO_INT32 = ("top_k", "max_tokens", "min_tokens", "n")
_INT32_MAX = 2**31 - 1
# pagedserve's request fields, as a refusal names them, and vLLM's names for them.
_VLLM_FIELDS = (
    (re.compile(r"\bsampling\.structured\.(?=\w)"), "sampling_params."),
    (re.compile(r"\bsampling\.(?=\w)"), "sampling_params."),
    (re.compile(r"\bprompt_token_ids\b"), "tokenized.input_ids"),
)


def request_of(request: vllm_engine_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    """The pagedserve request that answers a vLLM request, its n samples included."""
    _refuse_unsupported(request)
    converted = generation_pb2.GenerateRequest(
        request_id=request.request_id, sampling=_sampling(request.sampling_params)
    )
    if request.WhichOneof("input") == "tokenized":
        converted.prompt_token_ids.extend(request.tokenized.input_ids)
    else:
        converted.prompt = request.text
    return converted


def in_vllm_terms(refusal: StatusError) -> StatusError:
    """A refusal of the converted request, naming the fields of the vLLM request that the caller sent."""
    message = refusal.message
    for pagedserve_field, vllm_field in _VLLM_FIELDS:
        message = pagedserve_field.sub(vllm_field, message)
    return StatusError.of(refusal.code, message)


def _sampling(params: vllm_engine_pb2.SamplingParams) -> generation_pb2.SamplingParams:
    """vLLM's SamplingParams as pagedserve's, with vLLM's defaults where a proto3 zero means unset."""
    for field in _UINT32_TO_INT32:
        if (value := getattr(params, field)) > _INT32_MAX:
            raise InvalidArgument(f"sampling_params.{field} is {value}, far past pagedserve's limit on it")
    sampling = generation_pb2.SamplingParams(
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty or 1.0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        n=params.n or 1,
    )
    if params.HasField("temperature"):
        sampling.temperature = params.temperature
    if params.HasField("max_tokens"):
        sampling.max_tokens = params.max_tokens
    if params.HasField("seed"):
        sampling.seed = params.seed
    for field in ("logprobs", "prompt_logprobs"):
        if params.HasField(field):
            value = getattr(params, field)
            if value < 0:
                raise InvalidArgument(f"sampling_params.{field} is {value} (all); at most {MAX_LOGPROBS}")
            setattr(sampling, field, value)
    for token_id, bias in params.logit_bias.items():
        if token_id < 0:
            raise InvalidArgument(f"sampling_params.logit_bias has token id {token_id}, which is negative")
        sampling.logit_bias[token_id] = bias
    _constrain(sampling.structured, params)
    return sampling


def _constrain(structured: generation_pb2.StructuredOutput, params: vllm_engine_pb2.SamplingParams) -> None:
    constraint = params.WhichOneof("constraint")
    if constraint == "structural_tag":
        raise Unimplemented("structural tags (structured outputs for tool-call formats) are not supported")
    if constraint == "json_object" and not params.json_object:
        raise InvalidArgument("sampling_params.json_object is false: set it true, or set no constraint")
    if constraint == "choice":
        structured.choice.choices.extend(params.choice.choices)
    elif constraint is not None:
        setattr(structured, constraint, getattr(params, constraint))


def _refuse_unsupported(request: vllm_engine_pb2.GenerateRequest) -> None:
    given = request.WhichOneof("input")
    if (
        given is None
        or (given == "tokenized" and not request.tokenized.input_ids)
        or (given == "text" and not request.text)
    ):
        raise InvalidArgument("the request has no input: set tokenized.input_ids or text to the prompt")
    if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
        raise Unimplemented("pagedserve serves text models: multimodal inputs are not supported")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise Unimplemented("pagedserve does not do prefill/decode disaggregation: no KV transfer parameters")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidArgument(
            f"data_parallel_rank is {request.data_parallel_rank}; this worker has rank 0 only"
        )
    if request.sampling_params.HasField("truncate_prompt_tokens"):
        raise Unimplemented("prompt truncation (truncate_prompt_tokens) is not supported by pagedserve yet")
