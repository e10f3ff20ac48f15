"""Errors that a caller can act on, each naming the gRPC status that reports it.

Code below the servicers raises one of these when the caller is at fault or the service cannot help now;
the message must say what to change. `rpc.ErrorInterceptor` turns them into statuses. Nothing maps Python's
built-in exceptions wholesale: a KeyError or ValueError escaping a handler is a bug, reported as INTERNAL
and logged with its traceback. The codes are the names of `grpc.StatusCode` members, so that this module,
and the engine core that raises these, stay free of gRPC.
"""

from __future__ import annotations

from typing import ClassVar


class StatusError(Exception):
    """An error with a gRPC status code (a `grpc.StatusCode` member's name) and a message for a person."""

    code: ClassVar[str] = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @staticmethod
    def of(code: str, message: str) -> StatusError:
        """The error for a status another process reported, to pass on with the same code and message."""
        kind = _BY_CODE.get(code)
        if kind is not None:
            return kind(message)
        error = StatusError(message)
        error.code = code  # type: ignore[misc]  # a status no class here names
        return error


class InvalidArgument(StatusError):
    """The request is malformed or out of range; the caller must change it."""

    code = "INVALID_ARGUMENT"


class NotFound(StatusError):
    """The request names something that does not exist (an ended lease, say)."""

    code = "NOT_FOUND"


class FailedPrecondition(StatusError):
    """The request is well formed, but the current state forbids it (a double free, say)."""

    code = "FAILED_PRECONDITION"


class PermissionDenied(StatusError):
    """The request touches what belongs to someone else."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(StatusError):
    """No room: a full queue, a prompt over the context, a pool over its memory budget."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(StatusError):
    """The service cannot serve now (no worker, the KV pool out of reach); retrying later may work."""

    code = "UNAVAILABLE"


class OutOfRange(StatusError):
    """The request names a position past what the service holds (a stream's sequence number, say)."""

    code = "OUT_OF_RANGE"


class DataLoss(StatusError):
    """A stream lost messages its caller needed; the caller must start over."""

    code = "DATA_LOSS"


class Unimplemented(StatusError):
    """The request asks for something this server does not do; the message says what it does instead."""

    code = "UNIMPLEMENTED"


class Internal(StatusError):
    """The service failed on a request that was not at fault; the log holds the details."""

    code = "INTERNAL"


_BY_CODE: dict[str, type[StatusError]] = {
    kind.code: kind
    for kind in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        OutOfRange,
        DataLoss,
        Unimplemented,
        Internal,
    )
}
