"""Shared test fixtures: fixture files, a loopback HTTP server that plays vLLM (well or badly), metric helpers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

FIXTURES = Path(__file__).parent / "fixtures"
VLLM_FIXTURES = FIXTURES / "vllm"
# real vLLM start-ups (figures, verbatim log lines, upstream source of each) and the geometry of their models
CASES = FIXTURES / "cases"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite tests/fixtures/e2e-output.txt from the current output"
    )


class FakeClock:
    """A monotonic clock that moves only when the test moves it, for ``Agent(monotonic=...)``: backoffs and
    intervals are then exercised exactly, without waiting for them in real time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fixture_text(name: str) -> str:
    return (VLLM_FIXTURES / name).read_text()


def selected_cases(request: pytest.FixtureRequest, test: str) -> list[str]:
    """The ``case`` parameters of the test function ``test`` in the requesting module that this session runs, in the
    order it runs them (after -k and the like): what a module fixture may prepare ahead."""
    return [
        item.callspec.params["case"]
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module is request.module and item.originalname == test
    ]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels), parsed by prometheus-client."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def run_plan(model_dir: Path, cc: dict[str, str], max_model_len: int, version: str, *extra: str) -> dict:
    """`vllm-capacity plan --format json` for a real server's model, with the KV budget and block size it reports
    in vllm:cache_config_info (``cc``) and its version."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "vllm_capacity", "plan", "--model-dir", str(model_dir), "--format", "json"),
            *("--kv-cache-memory", cc["kv_cache_memory_bytes"], "--block-size", cc["block_size"]),
            *("--max-model-len", str(max_model_len), "--vllm-version", version),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def value(text: str, metric: str, /, **labels: str) -> float | None:
    """The value of the one sample ``metric`` whose labels include ``labels``; None when absent."""
    found = [
        v
        for (n, lbls), v in samples(text).items()
        if n == metric and all(dict(lbls).get(k) == x for k, x in labels.items())
    ]
    assert len(found) <= 1, f"{metric} {labels}: {len(found)} samples"
    return found[0] if found else None


@dataclass
class FakeVllm:
    """What the loopback "vLLM" answers. Tests change these fields between scrapes."""

    metrics: str = ""
    models: str = '{"object":"list","data":[{"id":"tiny-llama","object":"model","max_model_len":1024}]}'
    version: str = '{"version":"0.32.0"}'
    status: int = 200
    content_type: str = "text/plain; version=0.0.4; charset=utf-8"
    delay: float = 0.0
    truncate_to: int | None = None  # send a Content-Length for the whole body but only this many bytes
    metrics_bytes: bytes | None = None  # sent instead of ``metrics`` when set (a body that is not UTF-8)
    requests: list[str] = field(default_factory=list)
    url: str = ""


@pytest.fixture
async def fake_vllm() -> AsyncIterator[FakeVllm]:
    state = FakeVllm(metrics=fixture_text("v1-0.32.0-cpu-idle.prom"))

    async def metrics(request: web.Request) -> web.StreamResponse:
        state.requests.append("/metrics")
        if state.delay:
            await asyncio.sleep(state.delay)
        body = state.metrics_bytes if state.metrics_bytes is not None else state.metrics.encode()
        if state.truncate_to is not None:
            resp = web.StreamResponse(status=200, headers={"Content-Type": state.content_type})
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[: state.truncate_to])
            request.transport.close()  # type: ignore[union-attr]
            return resp
        return web.Response(status=state.status, body=body, headers={"Content-Type": state.content_type})

    async def models(_: web.Request) -> web.Response:
        state.requests.append("/v1/models")
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
