"""The one interceptor that turns an exception escaping a handler into a gRPC status.

A `StatusError` becomes its own status and message. Anything else is a bug: the client gets INTERNAL with
the exception's type, and the log gets the traceback. A request that does not parse (a corrupt message,
invalid UTF-8 in a string field) is the caller's fault: INVALID_ARGUMENT, and one line in the log.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from pagedserve.plumbing.errors import InvalidArgument, StatusError

log = logging.getLogger(__name__)


def grpc_code(code: str) -> grpc.StatusCode:
    """The grpc.StatusCode a StatusError's code names."""
    return grpc.StatusCode[code]


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message that report an exception raised below a servicer."""
    if isinstance(exc, StatusError):
        return grpc_code(exc.code), exc.message
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}: {exc}); see the server's log"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, message = status_of(exc)
    if not isinstance(exc, StatusError):
        log.error("unexpected error in an RPC", exc_info=exc)
    await context.abort(code, message)


class _Malformed:
    """What a request that did not parse deserializes to, so that the handler can refuse it."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or a UnicodeDecodeError from a string field
            return _Malformed(exc)

    return deserialize


def _check(request: Any) -> Any:
    if isinstance(request, _Malformed):
        log.warning("refused a request that does not parse: %s", request.error)
        raise InvalidArgument(f"the request is not a valid message of this method's type: {request.error}")
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _check(request)


def _wrap_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(_input(request), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in behavior(_input(request), context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapped


def _input(request: Any) -> Any:
    """The request, checked: a message, or a stream of them checked as they arrive."""
    if hasattr(request, "__aiter__"):
        return _checked_stream(request)
    return _check(request)


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
            request_deserializer=_safe(handler.request_deserializer),
            unary_unary=_wrap(handler.unary_unary),
            unary_stream=_wrap(handler.unary_stream),
            stream_unary=_wrap(handler.stream_unary),
            stream_stream=_wrap(handler.stream_stream),
        )
