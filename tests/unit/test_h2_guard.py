"""The public port's HTTP/2 guard, fed the client's side of a connection in pieces of every size: whole
requests pass, a header block too large or of too many CONTINUATION frames is caught where it crosses the
limit (the relay and the flood on a real stack: tests/integration/test_http2_abuse.py); and in front of a
real gRPC server, the connections it keeps open are bounded, in all and by client address."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from asyncio import selector_events
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.frontend import h2_guard
from services.frontend.h2_guard import PREFACE, GuardedPort, HeaderBlockGuard, _ClientSide

DATA, HEADERS, SETTINGS, CONTINUATION = 0x0, 0x1, 0x4, 0x9
END_STREAM, END_HEADERS = 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + struct.pack(">BBI", kind, flags, stream) + payload


def fed(data: bytes, piece: int, max_block_bytes: int = 1000, max_continuations: int = 4) -> str | None:
    """What the guard says of data, fed piece bytes at a time (the first problem, if any)."""
    guard = HeaderBlockGuard(max_block_bytes, max_continuations)
    for at in range(0, len(data), piece):
        if (problem := guard.feed(data[at : at + piece])) is not None:
            return problem
    return None


PIECES = [1, 2, 7, 9, 10, 4096]
REQUEST = (
    PREFACE
    + frame(SETTINGS, 0, 0, b"")
    + frame(HEADERS, END_HEADERS, 1, b"h" * 300)
    + frame(DATA, END_STREAM, 1, b"d" * 70000)  # a payload far over the block limit is no header
    + frame(HEADERS, 0, 3, b"h" * 400)
    + frame(CONTINUATION, 0, 3, b"c" * 400)
    + frame(CONTINUATION, END_HEADERS, 3, b"c" * 199)  # 999 bytes: at the limit
)


@pytest.mark.parametrize("piece", PIECES)
def test_requests_within_the_limits_pass(piece: int) -> None:
    assert fed(REQUEST * 1, piece) is None
    assert fed(REQUEST + REQUEST[len(PREFACE) :], piece) is None  # blocks reset at END_HEADERS


@pytest.mark.parametrize("piece", PIECES)
def test_a_block_over_its_bytes_is_caught(piece: int) -> None:
    flood = PREFACE + frame(HEADERS, 0, 1, b"h" * 600) + frame(CONTINUATION, 0, 1, b"c" * 401)
    assert fed(flood, piece) == "a header block of more than 1000 bytes"


@pytest.mark.parametrize("piece", PIECES)
def test_a_block_of_too_many_continuations_is_caught_even_empty_ones(piece: int) -> None:
    flood = PREFACE + frame(HEADERS, 0, 1, b"h") + frame(CONTINUATION, 0, 1, b"") * 5
    assert fed(flood, piece) == "a header block of more than 4 CONTINUATION frames"
    assert fed(PREFACE + frame(HEADERS, 0, 1, b"h") + frame(CONTINUATION, 0, 1, b"") * 4, piece) is None


def test_a_single_headers_frame_over_the_limit_is_caught() -> None:
    assert fed(PREFACE + frame(HEADERS, END_HEADERS, 1, b"h" * 1001), 4096) is not None


@pytest.mark.parametrize("late_s", [0.0, 0.3])
def test_a_call_through_the_relay_reaches_grpc_with_the_clients_own_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late_s: float
) -> None:
    """A gRPC server behind the guard sees each connection as a unix peer of its own, which the guard turns
    back into the client's TCP address, port and all; also when the client's first bytes come before the
    guard has reached gRPC (late_s: the connection to gRPC made that much later), which must be held, not
    dropped (Python 3.11.2's transports, Debian 12's, start reading after connection_made, paused or not)."""
    reach = _ClientSide._reach_grpc

    async def late(self: _ClientSide, transport: asyncio.Transport) -> None:
        await asyncio.sleep(late_s)
        await reach(self, transport)

    def add_reader_as_311_2(transport: Any, fd: int, callback: Any, *args: Any) -> None:
        if not transport._closing:  # Debian 12's Python 3.11.2: no is_reading() check here
            transport._loop._add_reader(fd, callback, *args)

    monkeypatch.setattr(_ClientSide, "_reach_grpc", late)
    monkeypatch.setattr(selector_events._SelectorTransport, "_add_reader", add_reader_as_311_2)

    async def scenario() -> tuple[str, str]:
        port = GuardedPort(
            str(tmp_path / "grpc.sock"), max_block_bytes=32768, max_connections=16, max_client_connections=16
        )

        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return port.peer_of(context.peer()).encode()

        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("t.T", {"Peer": grpc.unary_unary_rpc_method_handler(echo)})]
        )
        server.add_insecure_port(f"unix:{port.inner_path}")
        await server.start()
        address = await port.start("127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                seen = (await channel.unary_unary("/t.T/Peer")(b"")).decode()
                return seen, address
        finally:
            port.stop()
            await server.stop(0)

    seen, address = asyncio.run(scenario())
    host, _, client_port = seen.removeprefix("ipv4:").rpartition(":")
    assert host == "127.0.0.1" and client_port.isdigit() and client_port != address.rsplit(":", 1)[1]


async def echo_server(path: str) -> grpc.aio.Server:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})]
    )
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    return server


async def kept_open(address: str, source: str, seconds: float = 0.3) -> bool:
    """Whether a connection from source (a loopback address) that sends nothing stays open for seconds."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
    try:
        return await asyncio.wait_for(reader.read(1), seconds) != b""
    except TimeoutError:
        return True
    except ConnectionResetError:
        return False
    finally:
        writer.close()


def test_idle_connections_are_bounded_in_all_by_client_and_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Idle connections of one address once took every file descriptor of the frontend (three each), and
    no one else could connect: now one address holds at most max_client_connections, everyone together
    max_connections, and a connection that sends no HTTP/2 preface is closed after preface_timeout_s. The
    first refusal is logged at once, and one within the log's interval when the interval ends."""
    monkeypatch.setattr(h2_guard, "LOG_EVERY_S", 0.5)

    async def scenario() -> None:
        port = GuardedPort(
            str(tmp_path / "grpc.sock"),
            max_block_bytes=32768,
            max_connections=3,
            max_client_connections=2,
            preface_timeout_s=1.0,
        )
        server = await echo_server(port.inner_path)
        address = await port.start("127.0.0.1:0")
        host, number = address.rsplit(":", 1)
        try:
            idle = [
                await asyncio.open_connection(host, int(number), local_addr=("127.0.0.2", 0)) for _ in "ab"
            ]
            assert not await kept_open(address, "127.0.0.2"), "a third connection of one address"
            async with grpc.aio.insecure_channel(address) as channel:  # another address: its one connection
                assert await channel.unary_unary("/t.T/Echo")(b"hi") == b"hi"
                assert not await kept_open(address, "127.0.0.3"), "a fourth connection in all"
            for reader, _ in idle:  # no preface: closed when it is due (gRPC's own preface came first)
                with contextlib.suppress(ConnectionResetError):
                    await asyncio.wait_for(reader.read(), 5)
            assert await kept_open(address, "127.0.0.2"), "their places are free again"
            refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
            assert refusals == [
                "refused 1 connection(s) since the last such line; the last: 127.0.0.2 has 2 open "
                "(--max-client-connections)",
                "refused 1 connection(s) since the last such line; the last: 3 connections are open "
                "(--max-connections)",
            ]
        finally:
            port.stop()
            await server.stop(0)

    asyncio.run(scenario())
