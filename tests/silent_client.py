"""A gRPC client that never reads: it opens calls over HTTP/2 with a receive window of 0 and answers pings,
so the server may send headers but not one message, and sees a live, healthy connection all along.

Built on h2, the HTTP/2 state machine, over a plain socket: gRPC's own clients always read.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import h2.config
import h2.connection
import h2.exceptions
import h2.settings
from google.protobuf.message import Message


class SilentClient:
    def __init__(self, host: str, port: int) -> None:
        self._socket = socket.create_connection((host, port))
        self._h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self._lock = threading.Lock()
        self._authority = f"{host}:{port}"
        with self._lock:
            self._h2.initiate_connection()
            self._h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
            self._flush()
        threading.Thread(target=self._listen, daemon=True).start()

    def call(self, method: str, request: Message) -> int:
        """Start a unary-request call to /service/method; returns its stream id."""
        body = request.SerializeToString()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method),
            (":authority", self._authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        with self._lock:
            stream = self._h2.get_next_available_stream_id()
            self._h2.send_headers(stream, headers)
            self._h2.send_data(stream, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
            self._flush()
        return stream

    def close(self) -> None:
        self._socket.close()

    def _listen(self) -> None:
        """Answer pings and settings (h2 queues the acknowledgements); never acknowledge data."""
        while True:
            try:
                data = self._socket.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                try:
                    self._h2.receive_data(data)
                except h2.exceptions.ProtocolError:
                    return  # the connection is closed (the server sent GOAWAY): nothing more to answer
                self._flush()

    def _flush(self) -> None:
        with contextlib.suppress(OSError):  # closed by close(), or by the server: nothing left matters
            self._socket.sendall(self._h2.data_to_send())
