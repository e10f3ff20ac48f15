"""SMG's vLLM worker protocol at the edge: a `vllm.grpc.engine.GenerateRequest` as pagedserve's own request.

The gateway tokenizes and detokenizes itself, so a request arrives as token ids (or text) with vLLM's
sampling parameters, and what goes back is token ids. Each field is either given its vLLM meaning here or
refused by name: multimodal inputs, KV transfer, structured outputs, logit bias and prompt logprobs get
UNIMPLEMENTED, never silent neglect. Fields that only shape the gateway's own detokenization
(skip_special_tokens, spaces_between_special_tokens, include_stop_str_in_output) change no token, so they
are the gateway's to apply. `n` samples are n requests of the same prompt (`samples`).
"""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2

from pagedserve.plumbing.errors import InvalidArgument, Unimplemented
from pagedserve.v1 import generation_pb2
from services.common.sampling import MAX_LOGPROBS

MAX_SAMPLES = 16


def samples(request: vllm_engine_pb2.GenerateRequest) -> list[generation_pb2.GenerateRequest]:
    """The pagedserve requests that answer one vLLM request: one per sample of its `n`."""
    _refuse_unsupported(request)
    params = request.sampling_params
    n = params.n or 1
    if n > MAX_SAMPLES:
        raise InvalidArgument(f"sampling_params.n is {n}; at most {MAX_SAMPLES} samples a request")
    base = generation_pb2.GenerateRequest(request_id=request.request_id, sampling=_sampling(params))
    if request.WhichOneof("input") == "tokenized":
        base.prompt_token_ids.extend(request.tokenized.input_ids)
    else:
        base.prompt = request.text
    requests = []
    for index in range(n):
        sample = generation_pb2.GenerateRequest()
        sample.CopyFrom(base)
        if index and sample.sampling.HasField("seed"):
            sample.sampling.seed += index  # each sample its own draw, and the same ones for the same seed
        requests.append(sample)
    return requests


def _sampling(params: vllm_engine_pb2.SamplingParams) -> generation_pb2.SamplingParams:
    """vLLM's SamplingParams as pagedserve's, with vLLM's defaults where a proto3 zero means unset."""
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
    )
    if params.HasField("temperature"):
        sampling.temperature = params.temperature
    if params.HasField("max_tokens"):
        sampling.max_tokens = params.max_tokens
    if params.HasField("seed"):
        sampling.seed = params.seed
    if params.HasField("logprobs"):
        if params.logprobs < 0:
            raise InvalidArgument(
                f"sampling_params.logprobs is {params.logprobs} (every token); at most {MAX_LOGPROBS}"
            )
        sampling.logprobs = params.logprobs
    return sampling


def _refuse_unsupported(request: vllm_engine_pb2.GenerateRequest) -> None:
    if request.WhichOneof("input") is None:
        raise InvalidArgument("the request has no input: set tokenized or text")
    if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
        raise Unimplemented("pagedserve serves text models: multimodal inputs are not supported")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise Unimplemented("pagedserve does not do prefill/decode disaggregation: no KV transfer parameters")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidArgument(
            f"data_parallel_rank is {request.data_parallel_rank}; this worker has rank 0 only"
        )
    params = request.sampling_params
    constraint = params.WhichOneof("constraint")
    if constraint is not None:
        raise Unimplemented(f"structured outputs ({constraint}) are not supported by pagedserve yet")
    for field, what in (
        ("prompt_logprobs", "prompt logprobs"),
        ("truncate_prompt_tokens", "prompt truncation (truncate_prompt_tokens)"),
    ):
        if params.HasField(field):
            raise Unimplemented(f"{what} is not supported by pagedserve yet")
    if params.logit_bias:
        raise Unimplemented("logit_bias is not supported by pagedserve yet")
    _check_min_tokens(params)


def _check_min_tokens(params: vllm_engine_pb2.SamplingParams) -> None:
    """min_tokens holds back EOS, stop tokens and stop strings until that many tokens are out; pagedserve
    takes it only where none of them can end a request early, where it changes nothing."""
    if params.min_tokens <= 1:
        return
    if not params.ignore_eos or params.stop or params.stop_token_ids:
        raise Unimplemented(
            f"min_tokens ({params.min_tokens}) is supported only with ignore_eos and no stop or "
            "stop_token_ids, where nothing can end the request before max_tokens"
        )
