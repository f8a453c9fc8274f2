"""A listener that holds up: a cap on connections, a deadline for a request's head, and every refusal counted.

aiohttp closes a connection idle for the keep-alive timeout (set by the CLI), but has no deadline for a client that
opens a connection and sends its headers slowly, and no cap on connections: 1,000 slow clients would hold 1,000
sockets and file descriptors. :class:`ConnectionGuard` wraps aiohttp's server (the protocol factory) so that, from
the moment a connection is accepted (before a TLS handshake, not after it),

* a connection that has not sent a whole request head (the blank line ending the headers) within
  :data:`HEADER_TIMEOUT` of opening is closed; a TLS handshake has :data:`HANDSHAKE_TIMEOUT` of that;
* at :data:`MAX_CONNECTIONS` open connections, a new one first evicts the oldest connection still waiting for its
  first request head (so slow clients cannot starve Prometheus), else the keep-alive connection idle the longest
  (so idle clients cannot lock out the kubelet's probes or a scraper); only if every connection is in the middle
  of a request is the new one answered ``503`` and closed.

With TLS the guard runs the handshake itself (asyncio's ``create_server(ssl=...)`` hands a connection over only
once its handshake is done: 500 connections that never sent a ClientHello were uncounted, had no deadline and held
300 KiB each), with a read buffer of :data:`TLS_READ_BUFFER` rather than asyncio's 256 KiB.

Each closure is counted by kind in the counter it is given (the agent's ``http_errors``, exported as
``vllm_capacity_http_errors_total{kind}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ssl
from asyncio import sslproto
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

HEADER_TIMEOUT = 10.0  # seconds from accept to the end of the first request's headers
HANDSHAKE_TIMEOUT = 5  # seconds from accept to the end of a TLS handshake (asyncio's default: 60)
MAX_CONNECTIONS = 512
TLS_READ_BUFFER = 32 * 1024  # a TLS record is at most 16 KiB: two fit
# after TRIM_AFTER connections were open at once, freed memory goes back to the system when TRIM_BELOW are left (a
# scraper's keep-alive and a probe stay open: all of them never close)
TRIM_AFTER, TRIM_BELOW = 64, 8
_HEAD_END = (b"\r\n\r\n", b"\n\n")
_HEAD_WINDOW = 3  # bytes of the previous chunk kept, so a head end split across chunks is seen

# kinds, as exported
HEADER_TIMEOUT_KIND = "header_timeout"
OVER_LIMIT = "over_connection_limit"
EVICTED = "evicted_slow_client"
EVICTED_IDLE = "evicted_idle_keepalive"


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, watched from its accept until its first request head is complete;
    with TLS it sits above the TLS layer and the guard holds the socket's own transport."""

    def __init__(self, guard: ConnectionGuard, inner: Any) -> None:
        self._guard, self._inner = guard, inner
        self._socket: asyncio.BaseTransport | None = None  # the accepted socket's transport: what a close aborts
        self.transport: asyncio.Transport | None = None  # what aiohttp writes to (the TLS layer's, with TLS)
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None
        self._connected = False  # aiohttp's protocol has its transport (after the handshake, with TLS)
        self.waiting = True  # for the first request head
        self.last_active = 0.0

    def accepted(self, socket_transport: asyncio.BaseTransport) -> None:
        """The socket is accepted: counted from now, under the head deadline."""
        self._socket = socket_transport
        loop = asyncio.get_running_loop()
        self.last_active = loop.time()
        self._timer = loop.call_later(self._guard.header_timeout, self._expire)
        self._guard.opened(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._socket is None:  # the accepted socket: plain HTTP, or TLS before its handshake
            self.accepted(transport)
            if self._guard.ssl_context is not None:
                return  # aiohttp sees the connection once the TLS layer has done the handshake
        self.transport = transport  # type: ignore[assignment]
        self._connected = True
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.last_active = asyncio.get_running_loop().time()
        if not self._connected:  # TLS, the client's first bytes (its ClientHello): the TLS layer starts now
            self._start_tls(data)
            return
        if self.waiting:
            seen = self._tail + data
            if any(end in seen for end in _HEAD_END):
                self._head_complete()
            else:
                self._tail = seen[-_HEAD_WINDOW:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._connected else None

    def _start_tls(self, first: bytes) -> None:
        """Hand the socket to a TLS layer (made only now: a connection that never sends a byte costs a few KiB, not
        the ~80 KiB of an OpenSSL session and its buffers) and give it the bytes already read."""
        assert self._socket is not None
        assert self._guard.ssl_context is not None
        layer = _TlsLayer(self, self._guard.ssl_context)
        self._socket.set_protocol(layer)
        layer.connection_made(self._socket)
        view = memoryview(first)
        while view and not self._socket.is_closing():
            buffer = layer.get_buffer(len(view))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            layer.buffer_updated(n)
            view = view[n:]

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone()
        if self._connected:
            self._connected = False
            self._inner.connection_lost(exc)

    def gone(self) -> None:
        """The socket is closed (also when a TLS handshake failed and aiohttp never saw the connection)."""
        self._head_complete()
        self._guard.closed(self)

    @property
    def idle(self) -> bool:
        """A keep-alive connection between requests (aiohttp's handler is not in a request)."""
        return not self.waiting and self._connected and not getattr(self._inner, "_request_in_progress", True)

    def close(self, kind: str | None) -> None:
        """Close for ``kind`` (counted; None: at exit, not counted), unless already closed."""
        if self._socket is not None and not self._socket.is_closing():
            if kind is not None:
                self._guard.errors[kind] += 1
            self._socket.abort()  # type: ignore[attr-defined]

    def _head_complete(self) -> None:
        self.waiting = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.waiting:
            self.close(HEADER_TIMEOUT_KIND)


class _TlsLayer(sslproto.SSLProtocol):
    """asyncio's TLS protocol, started by the guard at the client's first byte (the guard has counted and timed the
    connection since its accept), with a read buffer of TLS_READ_BUFFER, not 256 KiB (asyncio reads ``max_size``
    on the instance)."""

    max_size = TLS_READ_BUFFER

    def __init__(self, connection: _Guarded, context: ssl.SSLContext) -> None:
        super().__init__(
            asyncio.get_running_loop(),
            connection,
            context,
            None,  # type: ignore[arg-type]  # no waiter: asyncio's own accept passes one; nothing awaits it here
            server_side=True,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
        )
        self._connection = connection

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._connection.gone()


def _release_freed_memory() -> None:
    """Give the pages of freed memory back to the system (glibc's malloc_trim): hundreds of connections' TLS
    sessions leave their memory spread over the heap, and without this the process kept their peak for good."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _Refused(asyncio.Protocol):
    def __init__(self, tls: bool) -> None:
        self._tls = tls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._tls:  # nothing readable can be said before a handshake
            transport.abort()  # type: ignore[attr-defined]
            return
        transport.write(  # type: ignore[attr-defined]
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 24\r\nConnection: close\r\n\r\n"
            b"too many connections\r\n\r\n"
        )
        transport.close()


class ConnectionGuard:
    """A protocol factory for ``loop.create_server`` around aiohttp's ``web.Server`` (``AppRunner.server``). With
    ``ssl_context`` it serves TLS itself: give ``create_server`` no ``ssl``."""

    def __init__(
        self,
        server: Callable[[], Any],
        errors: Counter[str],
        *,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout: float = HEADER_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._server, self.errors = server, errors
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self.ssl_context = ssl_context
        self._open: OrderedDict[_Guarded, None] = OrderedDict()  # in the order they were accepted
        self._peak = 0  # most connections open at once since memory was last given back

    def __call__(self) -> asyncio.Protocol:
        if len(self._open) >= self.max_connections and not self._make_room():
            self.errors[OVER_LIMIT] += 1
            return _Refused(self.ssl_context is not None)
        return _Guarded(self, self._server())

    def _make_room(self) -> bool:
        """Evict the oldest connection still waiting for its first request head, else the keep-alive connection idle
        the longest; False when every connection is in a request."""
        victim = next((c for c in self._open if c.waiting), None)
        kind = EVICTED
        if victim is None:
            idle = [c for c in self._open if c.idle]
            victim = min(idle, key=lambda c: c.last_active) if idle else None
            kind = EVICTED_IDLE
        if victim is None:
            return False
        victim.close(kind)
        self._open.pop(victim, None)
        return True

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def abort_all(self) -> None:
        """Cut every connection still open (at exit, after the grace for requests in flight)."""
        for connection in list(self._open):
            connection.close(None)
        self._open.clear()

    def opened(self, connection: _Guarded) -> None:
        self._open[connection] = None
        self._peak = max(self._peak, len(self._open))

    def closed(self, connection: _Guarded) -> None:
        self._open.pop(connection, None)
        if len(self._open) <= TRIM_BELOW and self._peak >= TRIM_AFTER:
            self._peak = 0
            _release_freed_memory()
