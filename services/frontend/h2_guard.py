"""The public port's HTTP/2 guard: gRPC core reads a header block that never ends to its end.

A client may open a header block (HEADERS without END_HEADERS) and follow it with CONTINUATION frames
forever; gRPC core (1.85) refuses the stream once its metadata passes the limit, but keeps reading the
block, and its memory grows with the bytes (hundreds of MiB a connection: the CONTINUATION flood of
CVE-2024-27316). So the public port is this guard's: it takes each TCP connection (and its TLS, when the
frontend has a certificate), reads the client's side frame by frame (`HeaderBlockGuard`: frame headers
only, payloads are counted past), and relays the bytes both ways to gRPC's own listener on a unix socket
in a private folder. A header block over `max_block_bytes`, or of more than `max_continuations`
CONTINUATION frames, closes the connection at once. Each connection reaches gRPC over a unix connection of
its own, bound to a random abstract name, which gRPC gives its handlers as the call's peer
("unix-abstract:NAME"): `peer_of` turns it back into the client's address, for its share of admission.
Each direction reads only while the other can take what it writes, so a slow reader holds no more than
the transports' buffers.

Each connection costs the frontend three file descriptors (the client's, and both ends of the unix
connection), so the guard bounds them: `max_connections` in all, `max_client_connections` from one client
address, and a connection that has not sent HTTP/2's preface within `preface_timeout_s` is closed. Idle
connections from one client once took every descriptor, and no one else could connect. Refusals are logged
at most once every LOG_EVERY_S seconds, with their count: the first at once, those after it when the
interval ends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import time
from collections import Counter
from typing import Any

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_FRAME_HEADER = 9
_HEADERS, _PUSH_PROMISE, _CONTINUATION = 0x1, 0x5, 0x9
_END_HEADERS = 0x4
_ABSTRACT = "unix-abstract:"
LOG_EVERY_S = 10.0


class HeaderBlockGuard:
    """The client's side of one HTTP/2 connection, read frame by frame for its header blocks' sizes."""

    def __init__(self, max_block_bytes: int, max_continuations: int) -> None:
        self.max_block_bytes = max_block_bytes
        self.max_continuations = max_continuations
        self._preface = len(PREFACE)  # bytes of the connection preface still to come
        self._header = b""  # a frame header's first bytes, until it has all nine
        self._payload = 0  # bytes of the current frame's payload still to come
        self._block: int | None = None  # an open header block's bytes so far; None when none is open
        self._continuations = 0

    @property
    def past_preface(self) -> bool:
        return self._preface == 0

    def feed(self, data: bytes) -> str | None:
        """Take the next bytes the client sent; returns what is wrong, if they break a limit."""
        at, end = min(self._preface, len(data)), len(data)
        self._preface -= at
        while at < end:
            if self._payload:
                step = min(self._payload, end - at)
                self._payload -= step
                at += step
                continue
            need = _FRAME_HEADER - len(self._header)
            self._header += data[at : at + need]
            at += need
            if len(self._header) < _FRAME_HEADER:
                break
            header, self._header = self._header, b""
            self._payload = int.from_bytes(header[:3], "big")
            problem = self._frame(header[3], header[4], self._payload)
            if problem is not None:
                return problem
        return None

    def _frame(self, kind: int, flags: int, length: int) -> str | None:
        if kind in (_HEADERS, _PUSH_PROMISE):
            self._block, self._continuations = length, 0
        elif kind == _CONTINUATION and self._block is not None:
            self._block += length
            self._continuations += 1
        else:
            return None  # anything else in an open block is a protocol error, gRPC's to refuse
        if self._block > self.max_block_bytes:
            return f"a header block of more than {self.max_block_bytes} bytes"
        if self._continuations > self.max_continuations:
            return f"a header block of more than {self.max_continuations} CONTINUATION frames"
        if flags & _END_HEADERS:
            self._block = None
        return None


class GuardedPort:
    """The public TCP port in front of gRPC's listener at inner_path (see the module)."""

    def __init__(
        self,
        inner_path: str,
        *,
        max_block_bytes: int,
        max_connections: int,
        max_client_connections: int,
        preface_timeout_s: float = 10.0,
        max_continuations: int = 32,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.inner_path = inner_path
        self._limits = (max_block_bytes, max_continuations)
        self._tls = tls
        self._peers: dict[str, str] = {}  # "unix-abstract:NAME" -> the client's address, as gRPC writes one
        self._server: asyncio.Server | None = None
        self.max_connections, self.max_client_connections = max_connections, max_client_connections
        self.preface_timeout_s = preface_timeout_s
        self._open: Counter[str] = Counter()  # client host -> its connections open
        self._refused, self._last_refusal = 0, ""  # since the last log of refusals
        self._logged_at = -LOG_EVERY_S
        self._log_due: asyncio.TimerHandle | None = None

    def admit(self, host: str) -> bool:
        """Count a new connection from host in, or say why not (logged, at most every LOG_EVERY_S)."""
        if self._open.total() >= self.max_connections:
            why = f"{self.max_connections} connections are open (--max-connections)"
        elif self._open[host] >= self.max_client_connections:
            why = f"{host} has {self.max_client_connections} open (--max-client-connections)"
        else:
            self._open[host] += 1
            return True
        self._refused, self._last_refusal = self._refused + 1, why
        if self._log_due is None:
            wait = max(0.0, self._logged_at + LOG_EVERY_S - time.monotonic())
            self._log_due = asyncio.get_running_loop().call_later(wait, self._log_refusals)
        return False

    def _log_refusals(self) -> None:
        refused, why = self._refused, self._last_refusal
        log.warning("refused %d connection(s) since the last such line; the last: %s", refused, why)
        self._refused, self._logged_at, self._log_due = 0, time.monotonic(), None

    def closed(self, host: str) -> None:
        self._open[host] -= 1
        if not self._open[host]:
            del self._open[host]

    async def start(self, address: str) -> str:
        """Listen on address ("host:port"; port 0 picks one); returns the address bound."""
        host, port = address.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ClientSide(self), host.strip("[]") or None, int(port), ssl=self._tls, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()[1]
        return f"{host}:{bound}"

    def peer_of(self, peer: str) -> str:
        """The client's address behind a call's peer, or peer itself when it did not come through here."""
        return self._peers.get(peer, peer) if peer.startswith(_ABSTRACT) else peer

    def stop(self) -> None:
        """Take no new connections; those open go on until gRPC closes its side (its own stop drains them).
        Not wait_closed: from Python 3.12 it waits for those connections too."""
        if self._server is not None:
            self._server.close()
        if self._log_due is not None:  # refusals not logged yet: now
            self._log_due.cancel()
            self._log_refusals()


class _ClientSide(asyncio.Protocol):
    """One client connection: its bytes through the guard to gRPC, gRPC's back to it."""

    def __init__(self, port: GuardedPort) -> None:
        self._port = port
        self._guard = HeaderBlockGuard(*port._limits)
        self._transport: asyncio.Transport | None = None
        self._inner: asyncio.Transport | None = None
        self._early: list[bytes] = []  # what came before gRPC was reached (reading pauses at the first)
        self._name = f"pagedserve-{secrets.token_hex(16)}"
        self._host: str | None = None  # the client's, once admitted
        self._preface_due: asyncio.TimerHandle | None = None
        self._reaching: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        host = transport.get_extra_info("peername")[0]
        if not self._port.admit(host):
            transport.abort()
            return
        self._host = host
        loop = asyncio.get_running_loop()
        self._preface_due = loop.call_later(self._port.preface_timeout_s, self._preface_late)
        self._reaching = loop.create_task(self._reach_grpc(transport))

    def _preface_late(self) -> None:
        if not self._guard.past_preface:
            self._close()

    async def _reach_grpc(self, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + self._name)  # abstract: no file, gone with the socket
            sock.setblocking(False)
            await loop.sock_connect(sock, self._port.inner_path)
            inner, _ = await loop.create_unix_connection(lambda: _GrpcSide(transport), sock=sock)
        except OSError as exc:
            sock.close()
            log.warning("could not reach the frontend's own gRPC listener: %s", exc)
            transport.abort()
            return
        if transport.is_closing():
            inner.close()
            return
        self._inner = inner
        self._port._peers[_ABSTRACT + self._name] = _grpc_peer(transport.get_extra_info("peername"))
        for data in self._early:
            inner.write(data)
        if self._early:
            self._early.clear()
            transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        problem = self._guard.feed(data)
        if problem is not None:
            peer = self._port._peers.get(_ABSTRACT + self._name, "a client")
            log.warning("closed the connection of %s: %s", peer, problem)
            self._close()
            return
        if self._inner is None:  # not reached yet: hold this, and read no more until it is
            self._early.append(data)
            assert self._transport is not None
            self._transport.pause_reading()
            return
        self._inner.write(data)

    def eof_received(self) -> bool:
        if self._inner is not None and self._inner.can_write_eof():
            self._inner.write_eof()
        return self._port._tls is None  # half-open, so that gRPC may still answer (TLS cannot stay so)

    def connection_lost(self, exc: Exception | None) -> None:
        self._port._peers.pop(_ABSTRACT + self._name, None)
        if self._preface_due is not None:
            self._preface_due.cancel()
        if self._host is not None:
            self._port.closed(self._host)
        if self._inner is not None:
            self._inner.close()

    def pause_writing(self) -> None:  # the client reads slower than gRPC writes
        if self._inner is not None:
            self._inner.pause_reading()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_reading()

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.abort()
        if self._inner is not None:
            self._inner.abort()


class _GrpcSide(asyncio.Protocol):
    """gRPC's end of one relayed connection: what it writes goes to the client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self._client = client
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.close()

    def pause_writing(self) -> None:  # gRPC reads slower than the client writes
        self._client.pause_reading()

    def resume_writing(self) -> None:
        self._client.resume_reading()


def _grpc_peer(address: Any) -> str:
    """A socket's peer address as gRPC writes one: "ipv4:HOST:PORT" or "ipv6:[HOST]:PORT"."""
    host, port = address[0], address[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
