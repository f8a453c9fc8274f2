"""A listener that holds up: a cap on connections, a deadline for a request's head, and every refusal counted.

aiohttp closes a connection idle for the keep-alive timeout (set by the CLI), but has no deadline for a client that
opens a connection and sends its headers slowly, and no cap on connections: 1,000 slow clients would hold 1,000
sockets and file descriptors. :class:`ConnectionGuard` is the protocol factory around aiohttp's server so that,
from the moment a connection is accepted (before a TLS handshake, not after it),

* a connection that has not sent a whole request head (the blank line ending the headers) within
  :data:`HEADER_TIMEOUT` of opening is closed; a TLS handshake has ``tls.HANDSHAKE_TIMEOUT`` of that;
* at :data:`MAX_CONNECTIONS` open connections, a new one first evicts the oldest connection still waiting for its
  first request head (so slow clients cannot starve Prometheus), else the keep-alive connection idle the longest
  (so idle clients cannot lock out the kubelet's probes or a scraper); only if every connection is in the middle
  of a request is the new one answered ``503`` and closed. Whether a connection is in a request is told by the
  guard's aiohttp middleware (:attr:`ConnectionGuard.middleware`, outermost in the app) and by the bytes still
  waiting in its socket's write buffer.

With TLS the guard runs the handshake itself (asyncio's ``create_server(ssl=...)`` hands a connection over only
once its handshake is done: 500 connections that never sent a ClientHello were uncounted, had no deadline and held
300 KiB each). :class:`TlsTransport` is TLS over the accepted socket with the ``ssl`` module's memory BIOs
(``SSLContext.wrap_bio``, the public path ``ssl`` documents for event loops), made at the client's first byte: no
read buffer of its own, and nothing of asyncio's private TLS protocol.

Each closure is counted by kind in the counter it is given (the agent's ``http_errors``, exported as
``vllm_capacity_http_errors_total{kind}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ssl
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from vllm_capacity.web.tls import TlsTransport

HEADER_TIMEOUT = 10.0  # seconds from accept to the end of the first request's headers
MAX_CONNECTIONS = 512
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
    with TLS it sits below the TLS layer, on the socket's own transport."""

    def __init__(self, guard: ConnectionGuard, inner: Any) -> None:
        self._guard, self._inner = guard, inner
        self._socket: asyncio.Transport | None = None  # the accepted socket's transport: what a close aborts
        self._tls: TlsTransport | None = None  # made at the client's first byte, with TLS
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None
        self._connected = False  # aiohttp's protocol has its transport (after the handshake, with TLS)
        self.waiting = True  # for the first request head
        self.requests = 0  # aiohttp handlers running for this connection (the guard's middleware counts them)
        self.transports: list[asyncio.BaseTransport] = []  # the socket's, and the TLS one aiohttp is given
        self.last_active = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """The socket is accepted: counted from now, under the head deadline; aiohttp sees it now in plain HTTP,
        after the handshake with TLS."""
        assert isinstance(transport, asyncio.Transport)
        self._socket = transport
        loop = asyncio.get_running_loop()
        self.last_active = loop.time()
        self._timer = loop.call_later(self._guard.header_timeout, self._expire)
        self._guard.opened(self, transport)
        if self._guard.ssl_context is None:
            self._serve(transport)

    def _serve(self, transport: asyncio.Transport) -> None:
        self._connected = True
        self._inner.connection_made(transport)

    def tls_ready(self, tls: TlsTransport) -> None:
        """The handshake is done: aiohttp reads and writes through the TLS transport from now."""
        self._guard.opened(self, tls)
        self._serve(tls)

    def data_received(self, data: bytes) -> None:
        self.last_active = asyncio.get_running_loop().time()
        context = self._guard.ssl_context
        if context is None:
            self.received(data)
            return
        if self._tls is None:  # the client's first bytes (its ClientHello): the TLS session starts now
            assert self._socket is not None
            self._tls = TlsTransport(self, self._socket, context)
        self._tls.feed(data)

    def received(self, data: bytes) -> None:
        """Request bytes (plaintext, with TLS): watched for the first head's end, then aiohttp's."""
        if self.waiting:
            seen = self._tail + data
            if any(end in seen for end in _HEAD_END):
                self._head_complete()
            else:
                self._tail = seen[-_HEAD_WINDOW:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self._connected:
            return None
        keep_open = self._inner.eof_received()
        return None if self._tls is not None else keep_open  # TLS without close_notify: the connection ends

    def pause_writing(self) -> None:
        if self._connected:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._connected:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_complete()
        if self._tls is not None:
            self._tls.lost()
            self._tls = None  # no cycle left to wait for the garbage collector: the session is freed now
        self._guard.closed(self)
        if self._connected:
            self._connected = False
            self._inner.connection_lost(exc)

    @property
    def idle(self) -> bool:
        """A keep-alive connection between requests: no handler running, nothing left to send."""
        return (
            not self.waiting
            and self._connected
            and self.requests == 0
            and self._socket is not None
            and self._socket.get_write_buffer_size() == 0
        )

    def close(self, kind: str | None, *, graceful: bool = False) -> None:
        """Close for ``kind`` (counted; None: at exit, not counted), unless already closed: cut at once, or
        ``graceful`` once what is buffered (a TLS alert) is sent."""
        if self._socket is not None and not self._socket.is_closing():
            if kind is not None:
                self._guard.errors[kind] += 1
            if graceful:
                self._socket.close()
            else:
                self._socket.abort()

    def _head_complete(self) -> None:
        self.waiting = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.waiting:
            self.close(HEADER_TIMEOUT_KIND)


def _release_freed_memory() -> None:
    """Give the pages of freed memory back to the system (glibc's malloc_trim): hundreds of connections' TLS
    sessions leave their memory spread over the heap, and without this the process kept their peak for good."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _Refused(asyncio.Protocol):
    def __init__(self, tls: bool) -> None:
        self._tls = tls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self._tls:  # nothing readable can be said before a handshake
            transport.abort()
            return
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 24\r\nConnection: close\r\n\r\n"
            b"too many connections\r\n\r\n"
        )
        transport.close()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ConnectionGuard:
    """The guard of one listener: its :attr:`middleware` goes first in the app, and :meth:`serving` gives
    ``loop.create_server`` the protocol factory around aiohttp's ``web.Server`` (``AppRunner.server``). With
    ``ssl_context`` it serves TLS itself: give ``create_server`` no ``ssl``."""

    def __init__(
        self,
        errors: Counter[str],
        *,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout: float = HEADER_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.errors = errors
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self.ssl_context = ssl_context
        self._server: Callable[[], Any] | None = None
        self._open: OrderedDict[_Guarded, None] = OrderedDict()  # in the order they were accepted
        self._by_transport: dict[asyncio.BaseTransport, _Guarded] = {}  # what aiohttp's requests carry
        self._peak = 0  # most connections open at once since memory was last given back

    def serving(self, server: Callable[[], Any]) -> ConnectionGuard:
        """This guard as the protocol factory of ``server`` (aiohttp's, called once per accepted connection)."""
        self._server = server
        return self

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Marks the request's connection as in a request while aiohttp's handler runs: it is not evicted as idle."""
        connection = self._by_transport.get(request.transport) if request.transport is not None else None
        if connection is None:
            return await handler(request)
        connection.requests += 1
        try:
            return await handler(request)
        finally:
            connection.requests -= 1
            connection.last_active = asyncio.get_running_loop().time()

    def __call__(self) -> asyncio.Protocol:
        assert self._server is not None, "serving(server) first"
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
        self._forget(victim)
        return True

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def abort_all(self) -> None:
        """Cut every connection still open (at exit, after the grace for requests in flight)."""
        for connection in list(self._open):
            connection.close(None)
        self._open.clear()
        self._by_transport.clear()

    def opened(self, connection: _Guarded, transport: asyncio.BaseTransport) -> None:
        self._open[connection] = None
        self._by_transport[transport] = connection
        connection.transports.append(transport)
        self._peak = max(self._peak, len(self._open))

    def closed(self, connection: _Guarded) -> None:
        self._forget(connection)
        if len(self._open) <= TRIM_BELOW and self._peak >= TRIM_AFTER:
            self._peak = 0
            _release_freed_memory()

    def _forget(self, connection: _Guarded) -> None:
        self._open.pop(connection, None)
        for transport in connection.transports:
            self._by_transport.pop(transport, None)
