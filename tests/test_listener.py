"""The sidecar's listener under slow and many clients: a deadline for a request's head, a cap on connections that
evicts slow clients before it refuses anyone, every closure counted. Real sockets against a real aiohttp server."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from vllm_capacity.listener import EVICTED, HEADER_TIMEOUT_KIND, OVER_LIMIT, ConnectionGuard


class Listener:
    def __init__(self, port: int, guard: ConnectionGuard, errors: Counter[str]) -> None:
        self.port, self.guard, self.errors = port, guard, errors

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def get(self) -> bytes:
        """One whole request on a new connection; the status line of the answer (empty if closed unanswered)."""
        reader, writer = await self.connect()
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            return await reader.readline()
        finally:
            writer.close()
            await writer.wait_closed()


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    errors: Counter[str] = Counter()
    assert runner.server is not None
    guard = ConnectionGuard(runner.server, errors, max_connections=3, header_timeout=0.3)
    server = await asyncio.get_running_loop().create_server(guard, "127.0.0.1", 0)
    yield Listener(server.sockets[0].getsockname()[1], guard, errors)
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
    # three keep-alive connections that each sent a request: nothing to evict, a fourth is refused with 503
    for _, writer in slow:
        writer.close()
        await writer.wait_closed()
    await asyncio.sleep(0.4)
    kept = []
    for _ in range(3):
        reader, writer = await listener.connect()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        kept.append(writer)
    assert listener.guard.open_connections == 3
    assert (await listener.get()).startswith(b"HTTP/1.1 503")
    assert listener.errors[OVER_LIMIT] == 1
    for writer in kept:
        writer.close()
        await writer.wait_closed()
