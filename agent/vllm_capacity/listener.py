"""A listener that holds up: a cap on connections, a deadline for a request's headers, and every refusal counted.

aiohttp closes a connection idle for the keep-alive timeout (set by the CLI), but has no deadline for a client that
opens a connection and sends its headers slowly, and no cap on connections: 1,000 slow clients would hold 1,000
sockets and file descriptors. :class:`ConnectionGuard` wraps aiohttp's server (the protocol factory) so that

* a connection that has not sent a whole request head (the blank line ending the headers) within
  :data:`HEADER_TIMEOUT` of opening is closed;
* at :data:`MAX_CONNECTIONS` open connections, a new one first evicts the oldest connection still waiting for its
  first request head (so slow clients cannot starve Prometheus); if every connection has sent one, the new one is
  answered ``503`` and closed.

Each closure is counted by kind in the counter it is given (the agent's ``http_errors``, exported as
``vllm_capacity_http_errors_total{kind}``).
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

HEADER_TIMEOUT = 10.0  # seconds from accept to the end of the first request's headers
MAX_CONNECTIONS = 512
_HEAD_END = (b"\r\n\r\n", b"\n\n")
_HEAD_WINDOW = 3  # bytes of the previous chunk kept, so a head end split across chunks is seen

# kinds, as exported
HEADER_TIMEOUT_KIND = "header_timeout"
OVER_LIMIT = "over_connection_limit"
EVICTED = "evicted_slow_client"


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, watched until its first request head is complete."""

    def __init__(self, guard: ConnectionGuard, inner: Any) -> None:
        self._guard, self._inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None
        self.waiting = True  # for the first request head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._timer = asyncio.get_running_loop().call_later(self._guard.header_timeout, self._expire)
        self._guard.opened(self)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.waiting:
            seen = self._tail + data
            if any(end in seen for end in _HEAD_END):
                self._head_complete()
            else:
                self._tail = seen[-_HEAD_WINDOW:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_complete()
        self._guard.closed(self)
        self._inner.connection_lost(exc)

    def close(self, kind: str) -> None:
        """Close for ``kind`` (counted), unless already closed."""
        if self.transport is not None and not self.transport.is_closing():
            self._guard.errors[kind] += 1
            self.transport.abort()

    def _head_complete(self) -> None:
        self.waiting = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.waiting:
            self.close(HEADER_TIMEOUT_KIND)


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(  # type: ignore[attr-defined]
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 24\r\nConnection: close\r\n\r\n"
            b"too many connections\r\n\r\n"
        )
        transport.close()


class ConnectionGuard:
    """A protocol factory for ``loop.create_server`` around aiohttp's ``web.Server`` (``AppRunner.server``)."""

    def __init__(
        self,
        server: Callable[[], Any],
        errors: Counter[str],
        *,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout: float = HEADER_TIMEOUT,
    ) -> None:
        self._server, self.errors = server, errors
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self._open: OrderedDict[_Guarded, None] = OrderedDict()  # in the order they were accepted

    def __call__(self) -> asyncio.Protocol:
        if len(self._open) >= self.max_connections:
            slow = next((c for c in self._open if c.waiting), None)
            if slow is None:
                self.errors[OVER_LIMIT] += 1
                return _Refused()
            slow.close(EVICTED)
            self._open.pop(slow, None)
        return _Guarded(self, self._server())

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def abort_all(self) -> None:
        """Cut every connection still open (at exit, after the grace for requests in flight)."""
        for connection in list(self._open):
            if connection.transport is not None:
                connection.transport.abort()
        self._open.clear()

    def opened(self, connection: _Guarded) -> None:
        self._open[connection] = None

    def closed(self, connection: _Guarded) -> None:
        self._open.pop(connection, None)
