"""One sample's answer in SMG's vLLM protocol: pagedserve's responses as GenerateStreamChunk and
GenerateComplete messages.

As vLLM's own servicer does, a stream's chunks carry each step's new tokens (and their logprobs), and its
complete repeats the last step's tokens with the totals, which the gateway takes from the complete; a
non-streamed sample gets one complete holding every token.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from smg_grpc_proto.generated import vllm_engine_pb2

from pagedserve.v1 import generation_pb2
from services.frontend.generation import Sample

Reason = generation_pb2.GenerateResponse.FinishReason
FINISH_REASONS = {Reason.STOP: "stop", Reason.LENGTH: "length", Reason.ABORT: "abort"}


class SampleAnswer:
    def __init__(self, sample: Sample, stream: bool) -> None:
        self._index = sample.index
        self._sample = sample
        self._stream = stream
        self._token_ids: list[int] = []
        self._logprobs: list[generation_pb2.TokenLogprobs] = []
        self._prompt_logprobs: list[generation_pb2.TokenLogprobs] = []

    def messages(
        self, response: generation_pb2.GenerateResponse
    ) -> Iterator[vllm_engine_pb2.GenerateResponse]:
        """The messages that answer one response of the sample."""
        if self._stream and response.token_ids:
            chunk = vllm_engine_pb2.GenerateStreamChunk(
                token_ids=response.token_ids,
                prompt_tokens=self._sample.prompt_tokens,
                completion_tokens=len(response.token_ids),
                cached_tokens=response.usage.cached_prompt_tokens,
                index=self._index,
            )
            _add_logprobs(chunk.output_logprobs, response.logprobs)
            if response.prompt_logprobs:
                chunk.input_logprobs.CopyFrom(self._input_logprobs(response.prompt_logprobs))
            yield vllm_engine_pb2.GenerateResponse(chunk=chunk)
        self._token_ids.extend(response.token_ids)
        self._logprobs.extend(response.logprobs)
        self._prompt_logprobs.extend(response.prompt_logprobs)
        if response.finish_reason:
            yield vllm_engine_pb2.GenerateResponse(complete=self._complete(response))

    def _complete(self, last: generation_pb2.GenerateResponse) -> vllm_engine_pb2.GenerateComplete:
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=last.token_ids if self._stream else self._token_ids,
            finish_reason=FINISH_REASONS[last.finish_reason],
            prompt_tokens=self._sample.prompt_tokens,
            completion_tokens=len(self._token_ids),
            cached_tokens=last.usage.cached_prompt_tokens,
            index=self._index,
        )
        _add_logprobs(complete.output_logprobs, last.logprobs if self._stream else self._logprobs)
        if self._prompt_logprobs and not self._stream:
            complete.input_logprobs.CopyFrom(self._input_logprobs(self._prompt_logprobs))
        stop = last.WhichOneof("matched_stop")
        if stop == "matched_token_id":
            complete.matched_token_id = last.matched_token_id
        elif stop == "matched_stop_str":
            complete.matched_stop_str = last.matched_stop_str
        return complete

    def _input_logprobs(
        self, scored: Iterable[generation_pb2.TokenLogprobs]
    ) -> vllm_engine_pb2.InputLogProbs:
        """vLLM's prompt logprobs: the first prompt token has none, then one entry per token."""
        first = self._sample.first_prompt_token
        scored = list(scored)
        out = vllm_engine_pb2.InputLogProbs(token_ids=[first, *(entry.token_id for entry in scored)])
        out.token_logprobs.add()
        out.top_logprobs.add()
        for entry in scored:
            out.token_logprobs.add(value=entry.logprob)
            out.top_logprobs.add(
                token_ids=[top.token_id for top in entry.top], values=[top.logprob for top in entry.top]
            )
        return out


def _add_logprobs(
    out: vllm_engine_pb2.OutputLogProbs, logprobs: Iterable[generation_pb2.TokenLogprobs]
) -> None:
    for entry in logprobs:
        out.token_ids.append(entry.token_id)
        out.token_logprobs.append(entry.logprob)
        if entry.top:
            out.top_logprobs.add(
                token_ids=[top.token_id for top in entry.top], values=[top.logprob for top in entry.top]
            )
