"""The one interceptor that turns an exception escaping a handler into a gRPC status.

A `StatusError` becomes its own status and message. Anything else is a bug: the client gets INTERNAL with
the exception's type, and the log gets the traceback.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from pagedserve.plumbing.errors import StatusError

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
