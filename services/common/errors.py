"""Domain errors, and the one interceptor that maps every exception to a gRPC status.

Below the servicers, code raises plain exceptions: ValueError for bad input (INVALID_ARGUMENT), KeyError
for an unknown name (NOT_FOUND), PermissionError for someone else's resource (PERMISSION_DENIED),
ConnectionError for a backend that is down (UNAVAILABLE), and the two classes here where Python has no
built-in. The interceptor turns each into a status whose message is
the exception's own, so the message must say what to change. Anything else is a bug: it becomes INTERNAL
and is logged with its traceback.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class FailedPrecondition(ValueError):
    """The request is well formed, but the current state forbids it (a double free, say)."""


class ResourceExhausted(Exception):
    """No room: a pool over its memory budget, a full queue."""


# Checked in order: subclasses before their bases.
_STATUS_BY_EXCEPTION: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (ConnectionError, grpc.StatusCode.UNAVAILABLE),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an exception raised below a servicer."""
    for kind, code in _STATUS_BY_EXCEPTION:
        if isinstance(exc, kind):
            # KeyError's str() quotes its argument; the message reads better without.
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            return code, str(message)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in an RPC", exc_info=exc)
    await context.abort(code, message)


def _wrap_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapped


def _wrap(behavior: Callable[..., Any] | None) -> Callable[..., Any] | None:
    if behavior is None:
        return None
    return _wrap_stream(behavior) if inspect.isasyncgenfunction(behavior) else _wrap_unary(behavior)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping a handler to a gRPC status with an actionable message."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return handler._replace(
            unary_unary=_wrap(handler.unary_unary),
            unary_stream=_wrap(handler.unary_stream),
            stream_unary=_wrap(handler.stream_unary),
            stream_stream=_wrap(handler.stream_stream),
        )
