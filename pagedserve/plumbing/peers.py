"""Who is calling over TCP: the user behind a connection from this machine, and a guard built on it.

A TCP port, loopback included, is open to every user of the machine, and a connection carries no
credential of the process behind it. But the other end of a connection from this machine is a socket in
this network namespace, and the kernel lists each socket with its owner's uid in /proc/net/tcp and
/proc/net/tcp6 (what identd reads). `local_peer_uids` finds the peer's socket there while the connection is
open, so the answer cannot belong to another connection. A peer not listed there is on another machine (or
in another network namespace, such as another container): only the network decides who that may be.

`LocalUsersOnly` wraps a server's handlers so that a call from a local process of another user is refused
with PERMISSION_DENIED before its handler runs: the frontend's gateway listener, which serves the node's
control surface, answers only this user's (and root's) processes, and remote peers the network admits.
"""

from __future__ import annotations

import inspect
import ipaddress
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from pagedserve.plumbing.private import trusted_uids

_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"
Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def peer_address(peer: str) -> Address | None:
    """gRPC's `context.peer()` ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000") as an address and a port; None
    for a unix socket or anything else. An IPv4 address mapped into IPv6 comes back as IPv4."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    host, _, port = rest.rpartition(":")
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(port)


def local_peer_uids(peer: Address, server_port: int) -> set[int]:
    """The uids owning the sockets of this machine (this network namespace) that are `peer`'s end of a
    connection to server_port; empty when the peer is not here."""
    return {uid for local, remote_port, uid in _sockets() if local == peer and remote_port == server_port}


def _sockets() -> Iterator[tuple[Address, int, int]]:
    """(local address, remote port, uid) of every TCP socket but the listening ones."""
    for table in _TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] == _LISTEN:
                continue
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            yield _decode(fields[1]), remote_port, int(fields[7])


def _decode(hex_address: str) -> Address:
    """The kernel's "0100007F:1F90": the address as 32-bit words in host byte order, the port in hex."""
    host, port = hex_address.split(":")
    words = [int(host[i : i + 8], 16) for i in range(0, len(host), 8)]
    raw = struct.pack(f"={len(words)}I", *words)
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(port, 16)


def stranger(peer: str, server_port: int) -> str | None:
    """Why peer may not call: a process of this machine that runs as another user; None when it may."""
    address = peer_address(peer)
    if address is None:
        return None  # a unix socket: its file's mode (0600) already admits only this user
    others = local_peer_uids(address, server_port) - trusted_uids()
    if others:
        return f"the caller ({peer}) is a process of uid {min(others)}, not of this server's user"
    return None


class LocalUsersOnly(grpc.aio.ServerInterceptor):
    """Refuses, with PERMISSION_DENIED, a call from a local process of another user (see the module)."""

    def __init__(self, server_port: int, what: str) -> None:
        """what: the server, as the refusal names it."""
        self._server_port = server_port
        self._what = what

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return guarded(handler, self._check)

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        why = stranger(context.peer(), self._server_port)
        if why is not None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self._what} answers only its own user's processes: {why}",
            )


Check = Callable[[grpc.aio.ServicerContext], Any]


def guarded(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """handler with `await check(context)` before its behaviour; check aborts the call to refuse it.

    The peer is known only inside a call (an interceptor sees the method and metadata alone), so the check
    wraps each behaviour, keeping its form: a coroutine stays one, an async generator stays one.
    """

    def wrap(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await check(context)
                async for item in behaviour(request, context):
                    yield item

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await behaviour(request, context)

        return call

    kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
    return handler._replace(
        **{kind: wrap(getattr(handler, kind)) for kind in kinds if getattr(handler, kind) is not None}
    )
