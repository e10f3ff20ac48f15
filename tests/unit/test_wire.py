"""The conversions at the servicers' edges: plain values to messages and back, by field name."""

from __future__ import annotations

import grpc
import pytest
import torch

from memory_daemon.export import CudaHandle, PoolDescriptor, ShmHandle
from memory_daemon.shape import PoolShape
from memory_daemon.stats import PoolCounts, WorkerUsage
from memory_daemon.wire import (
    counts_from_pb,
    descriptor_from_pb,
    descriptor_to_pb,
    shape_from_pb,
    shape_to_pb,
)
from pagedserve.memory.v1 import memory_pb2
from pagedserve.plumbing.errors import InvalidArgument, ResourceExhausted, StatusError, Unavailable
from pagedserve.plumbing.messages import to_message
from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.common.structured import Constraint
from services.common.wire import (
    error_fields,
    error_of,
    request_from_pb,
    sampling_from_pb,
    sampling_to_pb,
    submit_pb,
)
from services.worker.core.sampler import sample
from services.worker.core.sequence import FinishReason, RequestOutput, Sequence
from services.worker.service import logprobs_pb, output_pb

SHAPE = PoolShape(num_layers=2, num_kv_heads=3, head_dim=64, dtype="bfloat16", page_size=8)


def test_sampling_options_survive_the_trip_to_a_worker() -> None:
    options = SamplingOptions(
        max_tokens=7,
        temperature=0.5,
        top_p=0.75,  # values a float32 field holds exactly, as the wire's fields are
        top_k=40,
        min_p=0.125,
        repetition_penalty=1.25,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=-3,
        stop_token_ids=(4, 5),
        ignore_eos=True,
        logprobs=3,
    )
    assert sampling_from_pb(sampling_to_pb(options)) == options
    unseeded = SamplingOptions(max_tokens=2)
    assert not sampling_to_pb(unseeded).HasField("seed")
    assert sampling_from_pb(sampling_to_pb(unseeded)) == unseeded


def test_unset_optional_fields_take_the_defaults_and_overrides_win() -> None:
    params = generation_pb2.SamplingParams(top_k=5)
    assert sampling_from_pb(params) == SamplingOptions(top_k=5)
    assert sampling_from_pb(params, max_tokens=9) == SamplingOptions(top_k=5, max_tokens=9)


def test_a_bad_sampling_value_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match=r"sampling\.temperature must be between 0\.0 and 100\.0"):
        sampling_from_pb(generation_pb2.SamplingParams(temperature=-1.0))


@pytest.mark.parametrize("error", [InvalidArgument("bad"), ResourceExhausted("full"), Unavailable("gone")])
def test_a_workers_error_reaches_the_frontend_with_its_status_and_message(error: StatusError) -> None:
    relayed = error_of(output_pb("r", RequestOutput("key", [], [], FinishReason.ABORT, error=error)))
    assert (type(relayed), relayed.code, relayed.message) == (type(error), error.code, error.message)


def test_an_unknown_status_passes_through_as_itself() -> None:
    fields = {"error": "slow down", "error_code": grpc.StatusCode.ABORTED.value[0]}
    relayed = error_of(worker_pb2.RequestOutput(request_id="r", **fields))  # type: ignore[arg-type]
    assert (relayed.code, relayed.message) == ("ABORTED", "slow down")
    assert error_fields(relayed) == fields


def test_an_engine_request_travels_as_a_submit_whole() -> None:
    options = SamplingOptions(
        max_tokens=9, seed=-3, structured=Constraint("regex", "[ab]+"), logit_bias=((4, 1.5),)
    )
    request = EngineRequest((5, 6, 7), options, priority=3, cache_salt="s", follows="2", generated=(8,))
    submit = submit_pb("4", request)
    assert (submit.request_id, list(submit.prompt_token_ids), list(submit.generated_token_ids)) == (
        "4",
        [5, 6, 7],
        [8],
    )
    assert request_from_pb(worker_pb2.Submit.FromString(submit.SerializeToString())) == request


def test_logprobs_to_pb() -> None:
    torch.manual_seed(62)
    logits = torch.randn(1, 16)
    seq = Sequence("r0", EngineRequest((1, 2, 3), SamplingOptions(temperature=0.0, logprobs=2)), 0)
    result = sample(logits, [seq]).logprobs[0]
    assert result is not None
    pb = logprobs_pb(result)
    assert pb.token_id == result.token_id == int(logits.argmax())
    assert pb.logprob == pytest.approx(result.logprob, abs=1e-6)
    assert [(t.token_id, pytest.approx(t.logprob, abs=1e-6)) for t in pb.top] == list(result.top)


def test_a_finished_output_names_its_reason() -> None:
    output = RequestOutput("key", [7], [], FinishReason.LENGTH, prompt_tokens=3, cached_prompt_tokens=2)
    pb = output_pb("r", output)
    assert (pb.finish_reason, list(pb.token_ids), pb.prompt_tokens, pb.cached_prompt_tokens, pb.error) == (
        generation_pb2.GenerateResponse.LENGTH,
        [7],
        3,
        2,
        "",
    )


def test_pool_shapes_descriptors_and_counts_survive_the_wire() -> None:
    assert shape_from_pb(shape_to_pb(SHAPE)) == SHAPE
    for handle in (ShmHandle("/dev/shm/pool.bin"), CudaHandle(b"\x01" * 64, offset=128, device_uuid="GPU-1")):
        descriptor = PoolDescriptor(3, SHAPE, 100, 100 * SHAPE.page_bytes, handle)
        assert descriptor_from_pb(descriptor_to_pb(descriptor)) == descriptor
    usage = WorkerUsage(1, "w", "m", 4, 2, 1, 8)
    counts = PoolCounts(10, 5, 4, 1, 1, 0, 0, 2, 1, 6, 3, workers=(usage,))
    pb = to_message(counts, memory_pb2.PoolStats, workers=[to_message(usage, memory_pb2.WorkerUsage)])
    assert counts_from_pb(pb) == counts


def test_a_shape_of_zero_pages_size_takes_the_default_and_a_bad_one_is_refused() -> None:
    assert (
        shape_from_pb(
            memory_pb2.PoolShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")
        ).page_size
        == 16
    )
    with pytest.raises(InvalidArgument, match="dtype must be one of float32, float16, bfloat16"):
        shape_from_pb(memory_pb2.PoolShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype="int8"))
