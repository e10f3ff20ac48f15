"""The Worker contract's shared conversions, used by the frontend's and the worker's servicers alone.

An `EngineRequest` travels as a Submit (`submit_pb`, `request_from_pb`: its one conversion). Sampling options
travel as the public `pagedserve.v1.SamplingParams`, resolved by the frontend (every field set), so each
sampling field is spelled once in the .proto and once in `SamplingOptions`. A worker's refusal or failure
travels as (message, grpc.StatusCode value), and the frontend passes it on unchanged.
"""

from __future__ import annotations

from typing import Any

import grpc

from pagedserve.plumbing.errors import InvalidArgument, StatusError
from pagedserve.plumbing.messages import from_message, to_message
from pagedserve.plumbing.status import grpc_code
from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.common.structured import Constraint

_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
# A worker sends each stream its load at least this often, so that silence means it is stuck or frozen.
HEARTBEAT_S = 1.0
SILENT_AFTER_S = 3 * HEARTBEAT_S  # a frontend stops routing to a worker silent for this long


def sampling_from_pb(params: generation_pb2.SamplingParams, **overrides: object) -> SamplingOptions:
    """Checked options from a request's sampling; an unset optional field takes its default.

    Raises InvalidArgument for a value out of range.
    """
    structured = constraint_from_pb(params.structured) if params.HasField("structured") else None
    return from_message(
        SamplingOptions,
        params,
        **{"logit_bias": tuple(sorted(params.logit_bias.items())), "structured": structured, **overrides},
    )


def sampling_to_pb(options: SamplingOptions) -> generation_pb2.SamplingParams:
    structured = None if options.structured is None else constraint_to_pb(options.structured)
    return to_message(
        options, generation_pb2.SamplingParams, logit_bias=dict(options.logit_bias), structured=structured
    )


def submit_pb(request_id: str, request: EngineRequest) -> worker_pb2.Submit:
    return to_message(
        request,
        worker_pb2.Submit,
        request_id=request_id,
        prompt_token_ids=request.prompt_ids,
        sampling=sampling_to_pb(request.options),
        generated_token_ids=request.generated,
    )


def request_from_pb(submit: worker_pb2.Submit) -> EngineRequest:
    """The request a Submit carries, its sampling options checked (InvalidArgument for one out of range)."""
    return EngineRequest(
        prompt_ids=tuple(submit.prompt_token_ids),
        options=sampling_from_pb(submit.sampling),
        priority=submit.priority,
        cache_salt=submit.cache_salt,
        follows=submit.follows,
        generated=tuple(submit.generated_token_ids),
        cache_ttl_seconds=submit.cache_ttl_seconds,
        tenant=submit.tenant,
    )


def constraint_from_pb(structured: generation_pb2.StructuredOutput) -> Constraint:
    kind = structured.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("sampling.structured is set but empty: set one of its kinds")
    if kind == "choice":
        return Constraint("choice", choices=tuple(structured.choice.choices))
    if kind == "json_object" and not structured.json_object:
        raise InvalidArgument(
            "sampling.structured.json_object is false: set it true, or leave sampling.structured unset"
        )
    return Constraint(kind, "" if kind == "json_object" else getattr(structured, kind))


def constraint_to_pb(constraint: Constraint) -> generation_pb2.StructuredOutput:
    if constraint.kind == "choice":
        choices = generation_pb2.StructuredOutput.Choices(choices=constraint.choices)
        return generation_pb2.StructuredOutput(choice=choices)
    if constraint.kind == "json_object":
        return generation_pb2.StructuredOutput(json_object=True)
    structured = generation_pb2.StructuredOutput()
    setattr(structured, constraint.kind, constraint.text)
    return structured


def error_fields(error: StatusError) -> dict[str, Any]:
    """A RequestOutput's error fields for an error."""
    return {"error": error.message, "error_code": grpc_code(error.code).value[0]}


def error_of(output: worker_pb2.RequestOutput) -> StatusError:
    """The error a worker reported for a request, with its status and message as they were."""
    code = _CODE_BY_VALUE.get(output.error_code, grpc.StatusCode.INTERNAL)
    return StatusError.of(code.name, output.error)
