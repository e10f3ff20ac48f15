"""The Worker contract's shared conversions, used by the frontend's and the worker's servicers alone.

Sampling options travel as the public `pagedserve.v1.SamplingParams`, resolved by the frontend (every field
set), so each sampling field is spelled once in the .proto and once in `SamplingOptions`. A worker's
refusal or failure travels as (message, grpc.StatusCode value), and the frontend passes it on unchanged.
"""

from __future__ import annotations

from typing import Any

import grpc

from pagedserve.plumbing.errors import StatusError
from pagedserve.plumbing.messages import from_message, to_message
from pagedserve.plumbing.status import grpc_code
from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2
from services.common.sampling import SamplingOptions

_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
# A worker sends each stream its load at least this often, so that silence means it is stuck or frozen.
HEARTBEAT_S = 1.0
SILENT_AFTER_S = 3 * HEARTBEAT_S  # a frontend stops routing to a worker silent for this long


def sampling_from_pb(params: generation_pb2.SamplingParams, **overrides: object) -> SamplingOptions:
    """Checked options from a request's sampling; an unset optional field takes its default.

    Raises InvalidArgument for a value out of range.
    """
    return from_message(SamplingOptions, params, **overrides)


def sampling_to_pb(options: SamplingOptions) -> generation_pb2.SamplingParams:
    return to_message(options, generation_pb2.SamplingParams)


def error_fields(error: StatusError) -> dict[str, Any]:
    """A RequestOutput's error fields for an error."""
    return {"error": error.message, "error_code": grpc_code(error.code).value[0]}


def error_of(output: worker_pb2.RequestOutput) -> StatusError:
    """The error a worker reported for a request, with its status and message as they were."""
    code = _CODE_BY_VALUE.get(output.error_code, grpc.StatusCode.INTERNAL)
    return StatusError.of(code.name, output.error)
