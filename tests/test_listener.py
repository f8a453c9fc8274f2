"""The sidecar's listener under slow and many clients: a deadline for a request's head, a cap on connections that
evicts slow clients before it refuses anyone, every closure counted. Real sockets against a real aiohttp server."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import trustme
from aiohttp import web

from vllm_capacity.web.listener import EVICTED, EVICTED_IDLE, HEADER_TIMEOUT_KIND, OVER_LIMIT, ConnectionGuard


async def _healthz(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One whole /healthz request on the connection; the status line of the answer (empty if closed unanswered)."""
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        return await reader.readline()
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


class Listener:
    def __init__(self, port: int, guard: ConnectionGuard, errors: Counter[str]) -> None:
        self.port, self.guard, self.errors = port, guard, errors

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def get(self) -> bytes:
        """One whole request on a new connection; the status line of the answer (empty if closed unanswered)."""
        return await _healthz(*await self.connect())


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    release = asyncio.Event()

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def slow(_: web.Request) -> web.Response:  # a request in progress until the test releases it
        await release.wait()
        return web.Response(text="done\n")

    errors: Counter[str] = Counter()
    guard = ConnectionGuard(errors, max_connections=3, header_timeout=0.3)
    app = web.Application(middlewares=[guard.middleware])
    app.add_routes([web.get("/healthz", healthz), web.get("/slow", slow)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    server = await asyncio.get_running_loop().create_server(guard.serving(runner.server), "127.0.0.1", 0)
    yield Listener(server.sockets[0].getsockname()[1], guard, errors)
    release.set()
    server.close()
    await runner.cleanup()


async def test_a_client_that_never_finishes_its_headers_is_closed(listener: Listener) -> None:
    reader, writer = await listener.connect()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the sidecar, not by the test's timeout
    assert listener.errors[HEADER_TIMEOUT_KIND] == 1
    writer.close()
    await writer.wait_closed()
    assert (await listener.get()).startswith(b"HTTP/1.1 200")  # the others are served as before


async def test_a_head_split_across_packets_is_whole(listener: Listener) -> None:
    reader, writer = await listener.connect()
    for part in (b"GET /healthz HTTP/1.1\r\n", b"Host: x\r\n\r", b"\n"):
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.05)
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.4)  # past the header deadline: a connection that sent its head is not closed for it
    assert listener.errors[HEADER_TIMEOUT_KIND] == 0
    writer.close()
    await writer.wait_closed()


async def test_at_the_cap_slow_clients_make_room_and_then_new_ones_are_refused(listener: Listener) -> None:
    slow = [await listener.connect() for _ in range(3)]  # the cap: three connections, none with a request head
    for _, writer in slow:
        writer.write(b"GET / HTTP/1.1\r\n")
    await asyncio.sleep(0.05)
    # Prometheus arrives: the oldest slow client is evicted, the scrape is served
    assert (await listener.get()).startswith(b"HTTP/1.1 200")
    assert listener.errors[EVICTED] == 1
    assert await asyncio.wait_for(slow[0][0].read(), 5) == b""
    for _, writer in slow:
        writer.close()
        await writer.wait_closed()
    await asyncio.sleep(0.4)


async def test_at_the_cap_the_longest_idle_keepalive_makes_room_for_the_probes(listener: Listener) -> None:
    """512 clients that each sent one /healthz and idle locked out the scrapes and the kubelet's probes (503): an
    idle keep-alive connection is evicted now, the longest idle first. Only when every connection is in the middle
    of a request is a new one refused."""
    kept = []
    for _ in range(3):  # the cap: three keep-alive connections, each after one request, idle
        reader, writer = await listener.connect()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        kept.append((reader, writer))
        await asyncio.sleep(0.05)
    assert listener.guard.open_connections == 3
    assert (await listener.get()).startswith(b"HTTP/1.1 200")  # a probe gets through
    assert listener.errors[EVICTED_IDLE] == 1 and listener.errors[OVER_LIMIT] == 0
    await asyncio.wait_for(kept[0][0].read(), 5)  # the longest idle: the rest of its answer, then closed
    assert kept[0][0].at_eof()
    for _, writer in kept:
        writer.close()
        await writer.wait_closed()
    await asyncio.sleep(0.1)
    busy = []
    for _ in range(3):  # three connections each in the middle of a request: nothing to evict
        reader, writer = await listener.connect()
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        busy.append(writer)
    await asyncio.sleep(0.1)
    assert (await listener.get()).startswith(b"HTTP/1.1 503")
    assert listener.errors[OVER_LIMIT] == 1
    for writer in busy:
        writer.close()
        await writer.wait_closed()


# --- TLS: guarded from the accept, not from the end of the handshake (#28 row 1) -----------------------------------


BIG = bytes(range(256)) * (3 * 4096)  # 3 MiB


@pytest.fixture
async def tls_listener() -> AsyncIterator[tuple[Listener, ssl.SSLContext]]:
    """The guard serving TLS itself (the sidecar's way): a certificate for 127.0.0.1 from a CA made here."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def big(_: web.Request) -> web.Response:  # many TLS records, past the socket's write-buffer limit
        return web.Response(body=BIG)

    errors: Counter[str] = Counter()
    guard = ConnectionGuard(errors, max_connections=3, header_timeout=0.5, ssl_context=server_context)
    app = web.Application(middlewares=[guard.middleware])
    app.add_routes([web.get("/healthz", healthz), web.get("/big", big)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    server = await asyncio.get_running_loop().create_server(guard.serving(runner.server), "127.0.0.1", 0)
    yield Listener(server.sockets[0].getsockname()[1], guard, errors), client_context
    server.close()
    await runner.cleanup()


async def _tls_get(port: int, context: ssl.SSLContext) -> bytes:
    return await _healthz(*await asyncio.open_connection("127.0.0.1", port, ssl=context))


async def test_tls_connections_are_counted_and_timed_from_their_accept(
    tls_listener: tuple[Listener, ssl.SSLContext], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections that never send a ClientHello were invisible to the guard (asyncio hands a TLS connection over
    only after its handshake): no count, no deadline, ~300 KiB each. They are counted at once now, closed by the
    head deadline, and no TLS session is made for them (that waits for the client's first byte)."""
    import vllm_capacity.web.listener as listener_module

    made: list[object] = []
    layer = listener_module.TlsTransport

    class Counted(layer):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object) -> None:
            made.append(self)
            super().__init__(*args)

    monkeypatch.setattr(listener_module, "TlsTransport", Counted)
    listener, context = tls_listener
    silent = [await listener.connect() for _ in range(2)]
    await asyncio.sleep(0.1)
    assert listener.guard.open_connections == 2 and made == []
    for reader, _ in silent:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the sidecar's deadline
    assert listener.errors[HEADER_TIMEOUT_KIND] == 2 and listener.guard.open_connections == 0
    assert (await _tls_get(listener.port, context)).startswith(b"HTTP/1.1 200")  # a real client is served
    assert len(made) == 1
    for _, writer in silent:
        writer.close()


async def test_at_the_cap_a_stalled_handshake_makes_room_for_a_tls_scrape(
    tls_listener: tuple[Listener, ssl.SSLContext],
) -> None:
    listener, context = tls_listener
    stalled = []
    for _ in range(3):  # the cap: three connections that began a handshake and stalled
        reader, writer = await listener.connect()
        writer.write(b"\x16\x03\x01")
        await writer.drain()
        stalled.append((reader, writer))
    await asyncio.sleep(0.1)
    assert listener.guard.open_connections == 3
    assert (await _tls_get(listener.port, context)).startswith(b"HTTP/1.1 200")
    assert listener.errors[EVICTED] == 1 and listener.errors[OVER_LIMIT] == 0
    assert await asyncio.wait_for(stalled[0][0].read(), 5) == b""
    for _, writer in stalled:
        writer.close()


async def test_tls_answers_whole_over_keep_alive_and_ends_on_the_clients_close_notify(
    tls_listener: tuple[Listener, ssl.SSLContext],
) -> None:
    """The TLS layer (ssl's memory BIOs over the socket): a 3 MiB answer under the socket's flow control, a second
    request on the same connection, and the client's close_notify ending the connection on the sidecar's side."""
    listener, context = tls_listener
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port, ssl=context)
    for _ in range(2):
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        assert f"content-length: {len(BIG)}" in head
        assert await reader.readexactly(len(BIG)) == BIG
    assert writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
    writer.close()  # sends close_notify
    await writer.wait_closed()
    for _ in range(50):
        if listener.guard.open_connections == 0:
            break
        await asyncio.sleep(0.02)
    assert listener.guard.open_connections == 0
    assert sum(listener.errors.values()) == 0  # nothing of it was an error


async def test_a_failed_or_stalled_handshake_is_counted_by_kind(
    tls_listener: tuple[Listener, ssl.SSLContext], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain HTTP to the TLS port fails the handshake (the client gets TLS's alert, then the close); a ClientHello
    begun and never finished is closed at the handshake deadline, before the head deadline."""
    import vllm_capacity.web.tls as tls

    listener, _ = tls_listener
    reader, writer = await listener.connect()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)
    assert not answer.startswith(b"HTTP") and listener.errors[tls.TLS_FAILED] == 1
    writer.close()
    monkeypatch.setattr(tls, "HANDSHAKE_TIMEOUT", 0.1)  # the fixture's head deadline is 0.5 s
    reader, writer = await listener.connect()
    writer.write(b"\x16\x03\x01")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 0.4) == b""
    assert listener.errors[tls.TLS_TIMEOUT] == 1 and listener.errors[HEADER_TIMEOUT_KIND] == 0
    writer.close()


async def test_a_closed_tls_connection_frees_its_session_without_the_garbage_collector(
    tls_listener: tuple[Listener, ssl.SSLContext], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TLS session held in a reference cycle waits for the collector: 500 stalled handshakes kept their ~50 KiB
    each after they were gone (bench/listener.py, "after they go"). Freed when the socket closes."""
    import gc
    import weakref

    import vllm_capacity.web.listener as listener_module

    made: list[weakref.ref[object]] = []

    class Watched(listener_module.TlsTransport):  # type: ignore[misc]
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            made.append(weakref.ref(self))

    monkeypatch.setattr(listener_module, "TlsTransport", Watched)
    listener, context = tls_listener
    gc.collect()
    gc.disable()
    try:
        reader, writer = await listener.connect()  # a handshake begun and cut by the head deadline
        writer.write(b"\x16\x03\x01")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        for _ in range(50):
            if listener.guard.open_connections == 0:
                break
            await asyncio.sleep(0.02)
        assert len(made) == 1 and made[0]() is None
    finally:
        gc.enable()
    assert (await _tls_get(listener.port, context)).startswith(b"HTTP/1.1 200")  # served as before
