"""``vllm-capacity serve``: the agent, its listener (and the probe listener) and the process around them: signals
(SIGTERM from the first line of ``main``, SIGHUP re-reading the web configuration) and an exit within a second.

The heavy imports (asyncio, aiohttp, structlog, the agent) wait inside the functions: ``--help`` and a usage error
never pay them (``tests/test_cli.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_capacity import __version__
from vllm_capacity.cli.configs import ServeConfig, SourceConfig
from vllm_capacity.cli.options import UsageError
from vllm_capacity.redaction import redact_url

if TYPE_CHECKING:  # the agent's imports (asyncio, aiohttp, structlog) wait for a command that runs it
    from vllm_capacity.live.agent import Agent

KEEPALIVE = 75.0  # seconds an idle keep-alive connection to the sidecar stays open
# SIGTERM to exit: requests in flight get this long, then their connections are cut (the kubelet kills at 30 s; a
# client that asked for /metrics and does not read held the exit for 122 s)
SHUTDOWN_GRACE = 0.5
_early_stop: list[int] = []  # SIGTERM / SIGINT that came before the event loop's handlers were installed


def note_early_stop(signum: int, _frame: object) -> None:
    _early_stop.append(signum)


def check_combination(values: SourceConfig) -> None:
    """Refuse options that each parse but do not go together."""
    if values.model_config is not None and values.model_dir is not None:
        raise UsageError("give --model-config or --model-dir, not both")


def build_agent(values: SourceConfig, interval: float, serve: ServeConfig | None = None) -> Agent:
    """The agent ``serve`` and ``report`` run (``serve``: the options only it has): the model, log, GPU and latency
    options, and the client of vLLM."""
    from vllm_capacity.derive.facts import ServedModel
    from vllm_capacity.live.agent import Agent, AgentSettings
    from vllm_capacity.sources.vllm_log import LogFollower, might_carry_figures

    check_combination(values)
    nvml = None
    if values.nvml != "off":
        from vllm_capacity.sources.nvml import NvmlSource
        from vllm_capacity.sources.nvml_scope import visible_selection

        gpus = values.gpus
        if isinstance(gpus, list):
            selection: list[str] | None = gpus
        else:  # "all", or by default the GPUs the container runtime made visible
            selection = None if gpus == "all" else visible_selection(dict(os.environ))
        # NVIDIA_VISIBLE_DEVICES=none or void: this container has no GPU; with --nvml auto there is nothing to read
        nvml = (
            None
            if selection == [] and values.nvml == "auto"
            else NvmlSource(
                selection=selection,
                deadline=values.timeout,
                # every GPU of the node may be visible: report those running vLLM, unless --gpus all asks for all
                narrow_to_vllm=selection is None and gpus != "all",
            )
        )
    settings = AgentSettings(
        interval=interval,
        models_refresh=serve.models_refresh if serve else AgentSettings.models_refresh,
        model=ServedModel(values.model_config or values.model_dir, values.tp, values.pp),
        flags=values.flags,
        nvml_required=values.nvml == "on",
        objectives=tuple(o for o in (values.slo_itl, values.slo_ttft) if o is not None),
        latency_half_life=values.latency_half_life,
    )
    vllm_log = LogFollower(Path(values.vllm_log), keep=might_carry_figures) if values.vllm_log else None
    return Agent(_client(values), settings, vllm_log=vllm_log, nvml=nvml)


def _client(values: SourceConfig) -> Any:
    from vllm_capacity.sources.vllm import VllmClient

    return VllmClient(
        values.vllm_url,
        timeout=values.timeout,
        max_body_bytes=values.max_body_size,
        api_key=values.api_key_file,
    )


async def _serve(values: ServeConfig) -> int:
    import asyncio
    import contextlib
    import signal

    import structlog

    log = structlog.get_logger("vllm_capacity")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if _early_stop:  # asked to stop while the modules were loading: nothing was started
        log.info("stopping", signal=signal.Signals(_early_stop[0]).name, before="serving")
        return 0
    agent = build_agent(values, values.interval, values)
    client = agent.client
    host, port = values.listen
    access, ssl_context = _web_access(values.web_config_file)
    runner, guard = await _runner(agent, values, access, ssl_context)
    try:
        listener = await _listen(guard, "--listen", values.listen)
        probes = await _probe_listener(agent, values.probe_listen)
    except OSError as err:
        await runner.cleanup()
        await client.aclose()
        print(f"vllm-capacity serve: error: {err}", file=sys.stderr)
        return 1
    _reload_on_sighup(values.web_config_file, access, guard)
    log.info("serving", version=__version__, listen=f"{host}:{port}", tls=ssl_context is not None,
             probe_listen=":".join(map(str, values.probe_listen)) if values.probe_listen else None,
             basic_auth=bool(access.auth.users), vllm_url=redact_url(values.vllm_url),
             interval_seconds=values.interval, api_key="set" if values.api_key_file else "unset")  # fmt: skip
    try:
        await agent.run(stop)
    finally:
        log.info("stopping")
        listener.close()
        if probes is not None:
            probes.close()
        # requests in flight get SHUTDOWN_GRACE; then every connection still open is cut, whatever its client does
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(runner.cleanup(), SHUTDOWN_GRACE + 0.25)
        guard.abort_all()
        await client.aclose()
    return 0


async def _runner(agent: Agent, values: ServeConfig, access: Any, ssl_context: Any) -> tuple[Any, Any]:
    """aiohttp's runner of the sidecar's app, set up, and the guard (a connection cap and a head deadline from
    accept; with TLS the guard runs the handshake itself) to listen with."""
    from aiohttp import web

    from vllm_capacity import log as log_setup
    from vllm_capacity.web.app import make_app
    from vllm_capacity.web.listener import ConnectionGuard

    guard = ConnectionGuard(agent.http_errors, ssl_context=ssl_context, max_connections=values.web_max_requests)
    app = make_app(
        agent,
        access=access,
        metrics_path=values.web_telemetry_path,
        process_metrics=not values.web_disable_exporter_metrics,
        gpu_device_series=values.gpu_device_series == "on",
        outer=(guard.middleware,),
    )
    # idle keep-alive connections closed after 75 s (aiohttp's default is an hour: thousands of idle clients add up)
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, keepalive_timeout=KEEPALIVE, shutdown_timeout=SHUTDOWN_GRACE
    )
    await runner.setup()
    log_setup.count_foreign_errors(agent.http_errors)
    assert runner.server is not None  # set up just above
    return runner, guard.serving(runner.server)


async def _listen(guard: Any, flag: str, address: tuple[str, int]) -> Any:
    """A listening server for ``guard``; an OSError says which flag and address (None: every interface, IPv4 and
    IPv6)."""
    import asyncio

    host, port = address
    try:
        return await asyncio.get_running_loop().create_server(guard, host or None, port, reuse_address=True)
    except OSError as err:
        raise OSError(f"{flag} {host}:{port}: {err.strerror}") from err


async def _probe_listener(agent: Agent, address: tuple[str, int] | None) -> Any:
    """--probe-listen: /healthz and /readyz in plain HTTP, behind a guard of their own (a small cap)."""
    if address is None:
        return None
    from aiohttp import web

    from vllm_capacity.web.app import make_probe_app
    from vllm_capacity.web.listener import ConnectionGuard

    guard = ConnectionGuard(agent.http_errors, max_connections=64)
    app = make_probe_app(agent, outer=(guard.middleware,))
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=KEEPALIVE)
    await runner.setup()
    assert runner.server is not None
    return await _listen(guard.serving(runner.server), "--probe-listen", address)


def _reload_on_sighup(path: Path | None, access: Any, guard: Any) -> None:
    """SIGHUP re-reads the web configuration, in a thread (bcrypt checks each hash: seconds at a high cost); without
    one there is nothing to re-read, and SIGHUP's default action (ending the process) must not apply."""
    import asyncio
    import signal

    import structlog

    reloads: set[asyncio.Future[None]] = set()

    def on_sighup() -> None:
        if path is None:
            structlog.get_logger("vllm_capacity").info(
                "sighup_ignored", reason="no --web.config.file: nothing to re-read"
            )
            return
        future = asyncio.ensure_future(_reload_web_config(path, access, guard))
        reloads.add(future)
        future.add_done_callback(reloads.discard)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)


def _web_access(path: Path | None) -> tuple[Any, Any]:
    """The listener's access rules and TLS context from --web.config.file (checked at start; read again here to use
    it): none without the file."""
    from vllm_capacity.web import config as webconfig
    from vllm_capacity.web.app import Access

    if path is None:
        return Access(), None
    web_config = webconfig.load(path)
    _say_ignored(web_config)
    access = Access(webconfig.Authenticator(web_config.users), dict(web_config.headers), web_config.allowed_sans)
    return access, webconfig.new_ssl_context(web_config) if web_config.tls else None


def _say_ignored(config: Any) -> None:
    """One warning for each exporter-toolkit key the web configuration gives that this listener does not implement."""
    import structlog

    for key in config.ignored:
        structlog.get_logger("vllm_capacity").warning(
            "web_config_key_ignored", key=key, hint="exporter-toolkit's key, not implemented here: accepted, no effect"
        )


async def _reload_web_config(path: Path, access: Any, guard: Any) -> None:
    """SIGHUP: read the web configuration again, off the event loop. A fresh TLS context serves the next handshakes
    (trusting exactly the client CA file as it is now: a CA removed from it is retired, not kept beside the new one),
    new users and headers the next requests; the listener stays. A file that no longer loads, for whatever reason,
    keeps the settings in force."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import structlog

    from vllm_capacity.web import config as webconfig

    log = structlog.get_logger("vllm_capacity")

    def load() -> tuple[Any, Any, Any]:
        config = webconfig.load(path)
        if bool(config.tls) != (guard.ssl_context is not None):
            raise webconfig.WebConfigError("turning TLS on or off needs a restart (the listener stays as it is)")
        fresh = webconfig.new_ssl_context(config) if config.tls else None
        return config, webconfig.Authenticator(config.users), fresh

    try:
        # a thread of its own (bcrypt hashes the decoy at the configured cost): never the pool the agent reads in
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-capacity-reload") as pool:
            config, auth, fresh = await asyncio.get_running_loop().run_in_executor(pool, load)
    except Exception as err:  # a WebConfigError, or what nothing foresaw: the settings in force stay
        log.error("web_config_reload_failed", file=str(path), error=str(err) or type(err).__name__,
                  kept="the settings in force")  # fmt: skip
        return
    access.auth, access.headers, access.allowed_sans = auth, dict(config.headers), config.allowed_sans
    if fresh is not None:
        guard.ssl_context = fresh  # the next connections' first byte starts their TLS with it
    _say_ignored(config)
    log.info("web_config_reloaded", file=str(path), tls=fresh is not None, users=len(config.users))


def run_serve(values: ServeConfig) -> int:
    """Serve until SIGTERM, then exit within about a second: worker threads still busy (a parse of a large body, an
    NVML call that hangs in the driver) are not waited for, as the interpreter's exit and asyncio.run would."""
    import asyncio

    rc = asyncio.new_event_loop().run_until_complete(_serve(values))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
