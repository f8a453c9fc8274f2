"""pytest's hooks and shared fixtures: a loopback HTTP server that plays vLLM (well or badly). What tests import
lives in tests/support/."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from support.doubles import FakeVllm
from support.files import fixture_text


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite tests/fixtures/e2e-output.txt from the current output"
    )


#: what passing tests measured, printed at the end of the run (a passing test's output is not shown): a wait on a real
#: server is sized from these figures, run after run. Collected in the process that runs the test: the serial runs
#: (the real servers) show them, the workers of a parallel run keep theirs.
_FIGURES: list[str] = []


@pytest.fixture
def record_figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Records a figure (a line of text) under the test's name, for the run's closing summary."""
    return lambda line: _FIGURES.append(f"{request.node.name}: {line}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("figures the tests measured")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture
async def fake_vllm() -> AsyncIterator[FakeVllm]:
    state = FakeVllm(metrics=fixture_text("v1-0.32.0-cpu-idle.prom"))

    async def metrics(request: web.Request) -> web.StreamResponse:
        state.requests.append("/metrics")
        state.authorization["/metrics"] = request.headers.get("Authorization")
        if state.delay:
            await asyncio.sleep(state.delay)
        body = state.metrics_bytes if state.metrics_bytes is not None else state.metrics.encode()
        if state.drip:
            resp = web.StreamResponse(status=200, headers={"Content-Type": state.content_type})
            await resp.prepare(request)
            piece = -(-len(body) // 20)  # 20 pieces, the last the shortest
            for at in range(0, len(body), piece):
                await asyncio.sleep(state.drip)
                await resp.write(body[at : at + piece])
            await resp.write_eof()
            return resp
        if state.truncate_to is not None:
            resp = web.StreamResponse(status=200, headers={"Content-Type": state.content_type})
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[: state.truncate_to])
            request.transport.close()  # type: ignore[union-attr]
            return resp
        headers = {"Content-Type": state.content_type, **({"Location": state.location} if state.location else {})}
        return web.Response(status=state.status, body=b"" if state.location else body, headers=headers)

    async def models(request: web.Request) -> web.Response:
        state.requests.append("/v1/models")
        state.authorization["/v1/models"] = request.headers.get("Authorization")
        return web.Response(text=state.models, content_type="application/json")

    async def version(_: web.Request) -> web.Response:
        return web.Response(text=state.version, content_type="application/json")

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/v1/models", models), web.get("/version", version)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


@pytest.fixture
def fake_vllm_thread():
    """A fake vLLM on its own thread and loop, for tests that call blocking subprocesses."""
    import threading

    from aiohttp import web

    ready = threading.Event()
    holder: dict = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()

        async def metrics(_):
            return web.Response(text=fixture_text("v1-0.32.0-cpu-saturated.prom"))

        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": "tiny-llama", "max_model_len": 1024}]})

        async def version(_):
            return web.json_response({"version": "0.32.0"})

        app = web.Application()
        app.add_routes([web.get("/metrics", metrics), web.get("/v1/models", models), web.get("/version", version)])
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        holder["loop"] = loop
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)
    yield holder["url"]
    holder["loop"].call_soon_threadsafe(holder["loop"].stop)
    thread.join(10)
