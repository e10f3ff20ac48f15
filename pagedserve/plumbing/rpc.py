"""gRPC server and channel set-up shared by the three processes.

Every server gets the error interceptor, grpc.health.v1, bounded message sizes, and keepalive settings
that notice a dead peer within seconds: the daemon reclaims a crashed worker's pages when its stream ends,
so a half-open connection must not linger.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.plumbing.errors import PermissionDenied
from pagedserve.plumbing.private import check_unix_peer
from pagedserve.plumbing.status import ErrorInterceptor

MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    *_KEEPALIVE,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
CHANNEL_OPTIONS = [
    *_KEEPALIVE,
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


class CannotListen(OSError):
    """A server's address is taken, or not one this machine can listen on: the process cannot start."""

    def __init__(self, where: str, reason: object) -> None:
        super().__init__(f"cannot listen on {where}: {reason}")


def run_process(
    serve: Coroutine[object, object, None],
    log: logging.Logger,
    start_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Run a process's serve() to its end: status 0, or 1 with one line saying why it could not start
    (its address, or one of start_errors), where a traceback would bury the reason."""
    expected: tuple[type[Exception], ...] = (CannotListen, *start_errors)
    try:
        asyncio.run(serve)
    except expected as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 as grpc_health's servicer serves it, but for Watch streams, which end at a graceful
    shutdown: NOT_SERVING, then UNAVAILABLE saying why. grpc_health's never end, so that a client watching
    (gRPC's client-side health checking) held the server's stop for its whole grace, then saw "Cancelling
    all calls"."""

    def __init__(self) -> None:
        self._status: dict[str, health_pb2.HealthCheckResponse.ServingStatus] = {"": _SERVING}
        self._changed = asyncio.Condition()
        self._stopping = False

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r} here")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        last = None
        while True:
            async with self._changed:  # written outside it: a slow reader holds up no one else
                await self._changed.wait_for(functools.partial(self._news, request.service, last))
                status, stopping = self._status_of(request.service), self._stopping
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if stopping:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    def _status_of(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus:
        return self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)

    def _news(self, service: str, last: health_pb2.HealthCheckResponse.ServingStatus | None) -> bool:
        return self._status_of(service) != last or self._stopping

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Set a service's status; ignored once the server is shutting down."""
        async with self._changed:
            if not self._stopping:
                self._status[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good, and every Watch ended."""
        async with self._changed:
            self._stopping = True
            self._status = dict.fromkeys(self._status, _NOT_SERVING)
            self._changed.notify_all()


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: HealthServicer
    address: str  # the bound address: a TCP port of 0 is replaced by the port the kernel chose

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    local_address: str | None = None,
    options: Sequence[tuple[str, int]] = (),
) -> RunningServer:
    """Start a grpc.aio server on address ("host:port" or "unix:/path") with health for service_names.

    interceptors (credential checks) run before the error interceptor; credentials make address serve TLS.
    local_address ("unix:/path") serves the same services without TLS, to this machine's own tools.
    options: channel arguments that replace SERVER_OPTIONS' of the same name.
    """
    chosen = dict(SERVER_OPTIONS) | dict(options)
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()], options=list(chosen.items()))
    register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in service_names:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
        if local_address is not None:
            server.add_insecure_port(local_address)
    except RuntimeError as exc:  # gRPC says only that it failed to bind
        where = " and ".join(filter(None, (address, local_address)))
        raise CannotListen(where, listen_refusal(address) or exc) from exc
    await server.start()
    if not address.startswith("unix:"):
        host = address.rsplit(":", 1)[0]
        address = f"{host}:{port}"
    return RunningServer(server, health, address)


def listen_refusal(address: str) -> str | None:
    """Why this machine will not listen on a TCP address (taken, not its own), from a socket of our own."""
    host, _, port = address.rpartition(":")
    if address.startswith("unix:") or not port.isdigit():
        return None
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, int(port)), family=family):
            return None
    except OSError as exc:
        return bind_error_reason(exc)


def bind_error_reason(exc: OSError) -> str:
    """The kernel's reason a bind failed, alone: Python's socket and asyncio add the address to it."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


# For a server that is starting: its socket is tried again within a tenth of a second, not after gRPC's
# reconnect backoff (1 s, growing), which found a process up to a second after it served.
_PROBE_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.max_reconnect_backoff_ms", 100)]


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None = None, probing: bool = False
) -> grpc.Channel:
    """A channel with our options: TLS when credentials are given; probing, one that waits for a server to
    come up."""
    options = CHANNEL_OPTIONS + (_PROBE_OPTIONS if probing else [])
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def wait_for_health(
    address: str, timeout_s: float, service: str = "", credentials: grpc.ChannelCredentials | None = None
) -> None:
    """Block until the server at address reports SERVING; raise TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    with open_channel(address, credentials, probing=True) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last_error = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.05)
    raise TimeoutError(f"{address} not healthy after {timeout_s:.0f}s: {last_error}")


async def check_peer_before_secret(address: str) -> None:
    """`private.check_unix_peer` for an asyncio client, before its first call carries the stack's secret.

    A refusal comes as a PERMISSION_DENIED grpc.aio.AioRpcError, the way every other failure to reach a
    server reaches a caller of an aio stub.
    """
    try:
        await asyncio.to_thread(check_unix_peer, address)
    except PermissionDenied as exc:
        raise grpc.aio.AioRpcError(grpc.StatusCode.PERMISSION_DENIED, details=exc.message) from None


def stop_signal() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, for a server's main coroutine to wait on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop
