"""TLS for the listener with public API only: the ``ssl`` module's memory BIOs (``SSLContext.wrap_bio``, the path
``ssl`` documents for event loops) over the accepted socket's asyncio transport.

asyncio's own TLS server (``create_server(ssl=...)``, or ``loop.start_tls``) makes a 256 KiB read buffer per
connection at its start and cannot be started on bytes already read; its protocol class is private
(``asyncio.sslproto``). :class:`TlsTransport` is made by the listener at the client's first byte, holds only
OpenSSL's session and what is in flight, and is aiohttp's transport once the handshake is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any, Protocol

HANDSHAKE_TIMEOUT = 5.0  # seconds from the client's first byte to the end of a TLS handshake (asyncio's default: 60)
TLS_READ_CHUNK = 16 * 1024  # plaintext taken from the TLS session at a time: one TLS record at most

# kinds of closure, as exported in vllm_capacity_http_errors_total{kind}
TLS_FAILED = "tls_handshake_failed"  # not TLS, a certificate refused, no shared protocol version or cipher
TLS_TIMEOUT = "tls_handshake_timeout"
TLS_BROKEN = "tls_error"  # a record that does not decrypt after the handshake


class Connection(Protocol):
    """What the TLS session tells the listener's connection."""

    def tls_ready(self, tls: TlsTransport) -> None: ...  # the handshake is done

    def received(self, data: bytes) -> None: ...  # plaintext

    def eof_received(self) -> bool | None: ...  # the client's close_notify

    def close(self, kind: str | None, *, graceful: bool = False) -> None: ...  # the socket, for kind


class TlsTransport(asyncio.Transport):
    """The TLS session of one connection, over its socket's transport, with ``ssl``'s memory BIOs: the socket's
    bytes go into the session, its plaintext to the connection (:meth:`Connection.received`), what aiohttp writes
    goes out encrypted. Made at the client's first byte, under :data:`HANDSHAKE_TIMEOUT` from then; aiohttp's
    transport once the handshake is done. Flow control is the socket's: its write buffer, its reading."""

    def __init__(self, connection: Connection, socket: asyncio.Transport, context: ssl.SSLContext) -> None:
        super().__init__()
        self._connection, self._socket, self._context = connection, socket, context
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._session = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._handshaken = self._closing = False
        self._protocol: asyncio.BaseProtocol | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT, self._fail, TLS_TIMEOUT
        )

    def feed(self, data: bytes) -> None:
        """Bytes from the socket: the handshake's, then records whose plaintext goes to the connection."""
        self._incoming.write(data)
        if not self._handshaken and not self._handshake():
            return
        while not self._closing:
            try:
                plaintext = self._session.read(TLS_READ_CHUNK)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLError:
                self._fail(TLS_BROKEN)
                return
            if not plaintext:  # the client's close_notify (ssl reads it as b"")
                self._connection.eof_received()
                self.close()
                return
            self._connection.received(plaintext)
        self._flush()

    def _handshake(self) -> bool:
        try:
            self._session.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return False
        except (ssl.SSLError, ValueError):  # ValueError: a certificate that cannot be read, mid-handshake
            self._flush()  # the alert that tells the client why, sent before the socket closes
            self._fail(TLS_FAILED, graceful=True)
            return False
        self._handshaken = True
        self._cancel_timer()
        self._flush()
        self._connection.tls_ready(self)
        return True

    def _flush(self) -> None:
        if self._outgoing.pending and not self._socket.is_closing():
            self._socket.write(self._outgoing.read())

    def _fail(self, kind: str, *, graceful: bool = False) -> None:
        self._cancel_timer()
        self._closing = True
        self._connection.close(kind, graceful=graceful)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def lost(self) -> None:
        """The socket is closed."""
        self._closing = True
        self._cancel_timer()

    # asyncio.Transport, for aiohttp

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        self._session.write(data)
        self._flush()

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closing or self._socket.is_closing()

    def close(self) -> None:
        """close_notify, then the socket closes once its buffer is sent."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(ssl.SSLError):  # SSLWantReadError: the client's close_notify is not awaited
            self._session.unwrap()
        self._flush()
        self._socket.close()

    def abort(self) -> None:
        self._closing = True
        self._socket.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sslcontext":
            return self._context
        if name == "ssl_object":
            return self._session
        if name == "peercert":
            return self._session.getpeercert() if self._handshaken else default
        if name == "cipher":
            return self._session.cipher() if self._handshaken else default
        return self._socket.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def is_reading(self) -> bool:
        return self._socket.is_reading()

    def pause_reading(self) -> None:
        self._socket.pause_reading()

    def resume_reading(self) -> None:
        self._socket.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._socket.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._socket.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._socket.set_write_buffer_limits(high, low)
