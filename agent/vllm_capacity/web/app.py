"""The sidecar's HTTP server (aiohttp): /metrics, /healthz, /readyz and a landing page at /.

With ``--web.config.file`` every endpoint but the probes asks for basic credentials, and the configured headers go
on every response. The probes stay open: the kubelet sends no credentials, and they say nothing but "serving".
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Middleware

from vllm_capacity import __version__
from vllm_capacity.exposition.render import RenderCache, process_registry
from vllm_capacity.live.agent import Agent
from vllm_capacity.web.config import Authenticator, CredentialChecks, allowed_peer

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
CHECKS_OVER_LIMIT = "credential_checks_over_limit"  # vllm_capacity_http_errors_total's kind for a 429


@dataclass
class Access:
    """Who may read the sidecar and which headers it sends; swapped whole when the web configuration is re-read."""

    auth: Authenticator = field(default_factory=lambda: Authenticator({}))
    headers: dict[str, str] = field(default_factory=dict)
    allowed_sans: tuple[str, ...] = ()  # a client certificate must name one of these (client_allowed_sans)


def _landing_page(agent: Agent, metrics_path: str) -> str:
    url = html.escape(agent.client.display_url)
    link, shown = html.escape(metrics_path.lstrip("/")), html.escape(metrics_path)
    return f"""<!doctype html>
<html><head><title>vllm-capacity</title></head>
<body><h1>vllm-capacity {__version__}</h1>
<p>KV-cache capacity and concurrency exporter for the vLLM server at <code>{url}</code>
(vLLM {"up" if agent.snapshot.up else "down"}).</p>
<ul><li><a href="{link}">{shown}</a></li><li><a href="healthz">/healthz</a></li>
<li><a href="readyz">/readyz</a></li></ul></body></html>
"""


def make_app(
    agent: Agent,
    *,
    process_metrics: bool = True,
    gpu_device_series: bool = True,
    access: Access | None = None,
    metrics_path: str = "/metrics",
    outer: Sequence[Middleware] = (),
) -> web.Application:
    """The sidecar's app; ``gpu_device_series``: False beside dcgm-exporter (--gpu-device-series off); ``outer``:
    middlewares ahead of its own (the listener's, that tells a connection in a request from an idle one)."""
    renders = RenderCache(agent, process_registry() if process_metrics else None, gpu_device_series=gpu_device_series)
    access = access if access is not None else Access()
    checks = CredentialChecks()

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        auth, headers = access.auth, dict(access.headers)  # one view, even if a reload swaps them meanwhile
        if request.path not in OPEN_PATHS and access.allowed_sans:
            peercert = request.transport.get_extra_info("peercert") if request.transport else None
            if not allowed_peer(peercert, access.allowed_sans):
                return web.Response(status=403, text="client certificate not allowed\n", headers=headers)
        if request.path not in OPEN_PATHS and auth.users:
            refused = await _credentials_refused(checks, auth, request, headers, agent)
            if refused is not None:
                return refused
        response = await handler(request)
        response.headers.update(headers)
        return response

    async def metrics(request: web.Request) -> web.Response:
        deadline = _scrape_deadline(request.headers.get("X-Prometheus-Scrape-Timeout-Seconds"))
        try:
            body, content_type = await asyncio.wait_for(renders.body(request.headers.get("Accept")), deadline)
        except TimeoutError:  # Prometheus has given up by now: say so rather than answer into a closed scrape
            return web.Response(status=503, text=f"the render did not finish within the scrape timeout ({deadline}s)\n")
        response = web.Response(body=body, headers={"Content-Type": content_type})
        response.enable_compression()  # gzip when the scraper asks (Prometheus always does); else as it is
        return response

    async def landing(_: web.Request) -> web.Response:
        return web.Response(text=_landing_page(agent, metrics_path), content_type="text/html")

    async def close_renders(_: web.Application) -> None:
        renders.close()
        checks.close()

    app = web.Application(middlewares=[*outer, guard])
    app.on_cleanup.append(close_renders)
    app.add_routes([web.get(metrics_path, metrics), *_probe_routes(agent), web.get("/", landing)])
    return app


async def _credentials_refused(
    checks: CredentialChecks, auth: Authenticator, request: web.Request, headers: dict[str, str], agent: Agent
) -> web.Response | None:
    """The answer to a request whose credentials do not pass (401), or that finds too many checks under way (429,
    counted); None when they pass. A bcrypt check takes tens of milliseconds: off the event loop, in the checks'
    own small pool (a known credential takes none)."""
    allowed = await checks.allows(auth, request.headers.get("Authorization"))
    if allowed is None:
        agent.http_errors[CHECKS_OVER_LIMIT] += 1
        return web.Response(status=429, text="too many credential checks at once\n",
                            headers={**headers, "Retry-After": "1"})  # fmt: skip
    if not allowed:
        realm = {"WWW-Authenticate": 'Basic realm="vllm-capacity"'}
        return web.Response(status=401, text="unauthorized\n", headers={**headers, **realm})
    return None


SCRAPE_TIMEOUT_OFFSET = 0.5  # seconds kept for the answer to travel (exporter-toolkit's --web.timeout-offset default)


def _scrape_deadline(header: str | None) -> float | None:
    """The time a render may take: Prometheus' X-Prometheus-Scrape-Timeout-Seconds less the offset; None (no
    deadline) without the header or with one that is not a positive number."""
    try:
        timeout = float(header) if header else 0.0
    except ValueError:
        return None
    return max(timeout - SCRAPE_TIMEOUT_OFFSET, 0.1) if 0 < timeout < float("inf") else None


def _probe_routes(agent: Agent) -> list[web.RouteDef]:
    async def healthz(_: web.Request) -> web.Response:
        # Liveness of the sidecar itself; deliberately independent of vLLM so a vLLM outage never restarts us.
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        # Readiness of the sidecar itself: its first cycle has finished, so /metrics tells the truth (vLLM down is
        # vllm_capacity_up 0, a metric and an alert). Never tied to vLLM: a native sidecar's readiness is the pod's,
        # and a scrape problem must not take vLLM out of its Service.
        if agent.ready:
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready: the first read of vLLM has not finished yet\n")

    return [web.get("/healthz", healthz), web.get("/readyz", readyz)]


def make_probe_app(agent: Agent, *, outer: Sequence[Middleware] = ()) -> web.Application:
    """/healthz and /readyz alone (--probe-listen): plain HTTP for the kubelet, whose probes carry no client
    certificate and no credentials. They say nothing but "serving" and "has read vLLM once"."""
    app = web.Application(middlewares=list(outer))
    app.add_routes(_probe_routes(agent))
    return app
