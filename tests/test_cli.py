"""The command line: flags and their environment twins, one-line errors, `serve` as a process, `report`.

Most tests call ``cli.main(argv, environ)`` in this process (``_main``); a few start the real command
(``_run``) for what only a process shows: the entry point, exit codes through the interpreter, signals."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import io
import json
import logging as stdlib_logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import structlog

from lab import free_port, stop_process
from support.doubles import FakeVllm
from support.exposition import value
from support.files import fixture_text
from vllm_capacity import cli
from vllm_capacity.cli import options
from vllm_capacity.cli.configs import ServeConfig
from vllm_capacity.derive.facts import ServerFlags

VLLM_CAPACITY = [sys.executable, "-m", "vllm_capacity"]


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`vllm-capacity serve ARGS` as its own process; its stderr (the log) is read when it ends."""
    return subprocess.Popen(
        [*VLLM_CAPACITY, "serve", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*VLLM_CAPACITY, *args], capture_output=True, text=True, env=env, timeout=60)


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def _main(*args: str, env: dict[str, str] | None = None) -> Result:
    """`vllm-capacity ARGS` in this process, with only ``env`` as its environment."""
    out, err = io.StringIO(), io.StringIO()
    # the command configures logging for the process (structlog, and the standard library's root logger): put
    # both back afterwards, so that pytest's own log capture stays in place
    saved_structlog = structlog.get_config()
    root = stdlib_logging.getLogger()
    saved_root = (root.handlers[:], root.level)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args), dict(env or {}))
        except SystemExit as exit_:  # argparse's own errors, and --version
            code = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            structlog.configure(**saved_structlog)
            root.handlers[:], root.level = saved_root
    return Result(code, out.getvalue(), err.getvalue())


def _resolve(argv: list[str], environ: dict[str, str]) -> ServeConfig:
    ns = options.build_parser().parse_args(["serve", *argv])
    serve = options.config("serve", ns, environ)
    assert isinstance(serve, ServeConfig)
    return serve


def test_defaults() -> None:
    v = _resolve([], {})
    assert v.vllm_url == "http://127.0.0.1:8000"
    assert v.interval == 5.0
    assert v.listen == ("", 9790)  # every interface, IPv4 and IPv6
    assert v.flags == ServerFlags()


@pytest.mark.parametrize("command", sorted(options.COMMANDS))
def test_each_command_has_a_typed_field_per_option(command: str) -> None:
    """A new option without its field (or a field without its option) fails here, not when a user runs it."""
    cls, table = options.COMMANDS[command]
    has = {f.name for f in dataclasses.fields(cls)}
    gathered = {key: name for name, (_, keys) in options.RECORDS.items() if name in has for key in keys}
    named = {gathered.get(o.key or o.dest, o.key or o.dest) for o in table}
    assert has - {"compared"} == named  # compared: plan's flags given several values


def test_the_scheduler_flags_reach_the_agent_as_one_record() -> None:
    """--max-model-len, --max-num-seqs and --max-num-batched-tokens: one ServerFlags, from the flag or its twin."""
    env = {"VLLM_CAPACITY_MAX_NUM_SEQS": "64"}
    got = _resolve(["--max-model-len", "8192", "--max-num-batched-tokens", "4096"], env).flags
    assert got == ServerFlags(max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=4096)
    told = ServerFlags(max_num_seqs=64)
    assert told.over(ServerFlags(max_model_len=1, max_num_seqs=8)) == ServerFlags(max_model_len=1, max_num_seqs=64)


def test_the_prometheus_exporters_flag_names() -> None:
    """--web.listen-address is --listen; --web.telemetry-path moves /metrics (not onto a probe or the landing page)."""
    assert _resolve(["--web.listen-address", "127.0.0.1:9100"], {}).listen == ("127.0.0.1", 9100)
    assert _resolve([], {"VLLM_CAPACITY_WEB_TELEMETRY_PATH": "/capacity"}).web_telemetry_path == "/capacity"
    for bad in ("metrics", "/healthz", "/", "/a b"):
        result = _main("serve", "--web.telemetry-path", bad)
        assert result.returncode == 2 and "--web.telemetry-path:" in result.stderr


def test_environment_twin_and_flag_precedence() -> None:
    env = {"VLLM_CAPACITY_INTERVAL": "250ms", "VLLM_CAPACITY_VLLM_URL": "http://vllm:8000"}
    assert _resolve([], env).interval == 0.25
    assert _resolve([], env).vllm_url == "http://vllm:8000"
    assert _resolve(["--interval", "1m"], env).interval == 60.0


def test_every_option_has_a_documented_twin() -> None:
    help_text = options.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for opt in options.SERVE_OPTIONS:
        assert opt.env.startswith("VLLM_CAPACITY_")
        assert opt.env in help_text.replace("\n", " ").replace("  ", " ") or opt.env in help_text


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["serve", "--interval", "50ms"], {}, "--interval: '50ms' is below the minimum 100ms"),
        (["serve", "--interval", "often"], {}, "--interval: 'often' is not a duration"),
        (["serve"], {"VLLM_CAPACITY_INTERVAL": "0"}, "VLLM_CAPACITY_INTERVAL (environment): '0' is below"),
        (["serve", "--vllm-url", "localhost:8000"], {}, "--vllm-url: 'localhost:8000' is not an http"),
        (["serve", "--listen", "9790"], {}, "--listen: '9790' is not host:port"),
        (["serve", "--max-model-len", "-5"], {}, "--max-model-len: '-5' is not a positive whole number"),
        (["serve", "--log-format", "xml"], {}, "--log.format: 'xml' is not one of json, logfmt, console"),
        (["serve", "--api-key-file", "/nonexistent/key"], {}, "--api-key-file: cannot read /nonexistent/key"),
        (["serve", "--bogus"], {}, "unrecognized arguments: --bogus"),
        (["report", "--format", "yaml"], {}, "--format: 'yaml' is not one of text, json"),
        (["serve", "--vllm-url", "http://h:notaport"], {}, "--vllm-url: 'http://h:notaport' is not a valid URL"),
        (["serve", "--vllm-url", "http://[bad"], {}, "--vllm-url: 'http://[bad' is not a valid URL"),
        (["serve", "--vllm-url", "http://vllm host:8000"], {}, "contains whitespace"),
        (["serve", "--vllm-url", "http://:8000"], {}, "names no host"),
        (["serve", "--vllm-url", "http://u:s3cret@h:x"], {}, "'http://***@h:x' is not a valid URL"),
        (["serve", "--interval", "10000000000h"], {}, "--interval: '10000000000h' is above the maximum 1h"),
        (["serve", "--timeout", "1h"], {}, "--timeout: '1h' is above the maximum 10m"),
        (["serve", "--max-body-size", "1000TiB"], {}, "--max-body-size: '1000TiB' is above the maximum 1GiB"),
    ],
)
def test_invalid_input_exits_2_with_one_line(argv: list[str], env: dict[str, str], message: str) -> None:
    result = _main(*argv, env=env)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"sk-one\nsk-two\n", "holds more than one line"),
        ("sk-caf\u00e9\n".encode(), "characters an API key cannot have"),
        (b"sk has spaces\n", "characters an API key cannot have"),
        (b"\xff\xfesk\n", "is not UTF-8 text"),
        (b"  \n", "is empty"),
    ],
)
def test_an_api_key_that_cannot_be_sent_is_refused_at_start(tmp_path: Path, content: bytes, message: str) -> None:
    """Checked before anything starts, naming the file and never the key (a key with a newline once reached the
    log inside h11's error message on every cycle)."""
    key = tmp_path / "key"
    key.write_bytes(content)
    result = _main("serve", "--api-key-file", str(key))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"--api-key-file: {key} " in line and message in line
    assert "sk-" not in line


def test_an_api_key_file_with_a_byte_order_mark() -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".key") as f:
        f.write("\ufeffsk-secret-1\n".encode())
        f.flush()
        assert _resolve(["--api-key-file", f.name], {}).api_key_file == "sk-secret-1"


def test_the_real_command_exits_2_on_a_bad_flag() -> None:
    result = _run("serve", "--interval", "often")
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("vllm-capacity serve: error: --interval: 'often' is not a duration")


def test_listen_address_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = _run("serve", "--listen", f"127.0.0.1:{port}", "--vllm-url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert f"--listen 127.0.0.1:{port}" in result.stderr


def test_help_and_usage_errors_import_no_server_stack() -> None:
    """--help and a usage error answer before asyncio, aiohttp, structlog or prometheus-client are imported (they
    are most of the start-up time; bench/cycle.py measures it)."""
    probe = (
        "import sys\n"
        "from vllm_capacity.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['serve', '--interval', 'soon']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
    )
    assert _imported_after(probe, {"asyncio", "aiohttp", "structlog", "prometheus_client", "httpx"}) == []


def _imported_after(probe: str, packages: set[str]) -> list[str]:
    """The modules of ``packages`` that a fresh interpreter has imported once it has run ``probe``."""
    report = f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(packages)!r}))\n"
    out = subprocess.run([sys.executable, "-c", "import sys\n" + probe + report], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_a_sidecar_without_nvml_or_a_web_config_loads_neither() -> None:
    """``serve --nvml off`` with no --web.config.file builds its agent and app without NVML's binding or the YAML
    parser: ~3.3 MiB of the sidecar's memory (bench/cycle.py, RSS at 1 engine) that it has no use for."""
    probe = (
        "import os, sys\n"
        "from vllm_capacity.cli.serve import build_agent\n"
        "from vllm_capacity.cli.options import build_parser, config\n"
        "ns = build_parser().parse_args(['serve', '--nvml', 'off', '--vllm-url', 'http://127.0.0.1:9'])\n"
        "values = config(ns.command, ns, dict(os.environ))\n"
        "from vllm_capacity.web.app import make_app\n"
        "make_app(build_agent(values, values.interval, values))\n"
    )
    assert _imported_after(probe, {"pynvml", "yaml"}) == []
    with_nvml = probe.replace("'--nvml', 'off'", "'--nvml', 'auto'")
    assert "pynvml" in _imported_after(with_nvml, {"pynvml"})  # the check can see the binding: --nvml auto loads it


def test_version() -> None:
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.startswith("vllm-capacity ")


async def test_serve_process_end_to_end(fake_vllm: FakeVllm, tmp_path) -> None:
    """The real `vllm-capacity serve` process: JSON logs, /metrics, the API key never logged, clean SIGTERM."""
    port = free_port()
    key = tmp_path / "key"
    key.write_text("sk-very-secret-123\n")
    url = fake_vllm.url.replace("http://", "http://scraper:pw-very-secret@")  # userinfo: never printed
    env = {**os.environ, "VLLM_CAPACITY_VLLM_URL": url, "VLLM_CAPACITY_API_KEY_FILE": str(key)}
    proc = _serve("--listen", f"127.0.0.1:{port}", "--interval", "100ms", env=env)
    try:
        text = ""
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                await asyncio.sleep(0.1)
                try:
                    text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
                except httpx.ConnectError:
                    continue
                if value(text, "vllm_capacity_up") == 1:
                    break
        assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 4096
        assert value(text, "vllm_capacity_process_resident_memory_bytes") > 0
        fake_vllm.metrics = fixture_text("v1-0.24-seed.prom")  # vLLM now serves another model: the agent follows
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
                if value(text, "vllm_capacity_kv_cache_capacity_tokens", model_name="gemma-12b") is not None:
                    break
                await asyncio.sleep(0.1)
        assert value(text, "vllm_capacity_kv_cache_capacity_tokens", model_name="gemma-12b") == 208625
    finally:
        _, stderr = stop_process(proc)
    assert proc.returncode == 0
    events = [json.loads(line) for line in stderr.splitlines()]
    assert {"serving", "vllm_discovered", "stopping"} <= {e["msg"] for e in events}
    assert "sk-very-secret" not in stderr and "pw-very-secret" not in stderr
    assert next(e for e in events if e["msg"] == "serving")["api_key"] == "set"


async def test_the_default_listener_serves_ipv4_and_ipv6(fake_vllm: FakeVllm) -> None:
    """`--listen :PORT` answers on 127.0.0.1 and on [::1]: an IPv6-only pod network can scrape it too."""
    port = free_port()
    proc = _serve("--vllm-url", fake_vllm.url, "--listen", f":{port}")
    try:
        answers = {}
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                await asyncio.sleep(0.1)
                for host in ("127.0.0.1", "[::1]"):
                    with contextlib.suppress(httpx.TransportError):
                        answers[host] = (await client.get(f"http://{host}:{port}/healthz")).status_code
                if len(answers) == 2:
                    break
    finally:
        stop_process(proc)
    assert answers == {"127.0.0.1": 200, "[::1]": 200}


def test_a_client_protocol_error_is_one_json_log_line(fake_vllm_thread: str) -> None:
    """aiohttp's own error log (a request line over 8 KiB) goes through the same JSON renderer: every stderr line
    is one JSON object, the traceback a field of it (it was a raw multi-line traceback); the same error again is
    counted, not logged again."""
    import socket

    port = free_port()
    proc = _serve("--vllm-url", fake_vllm_thread, "--listen", f"127.0.0.1:{port}")
    try:
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                threading.Event().wait(0.1)
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                assert c.recv(64).startswith(b"HTTP/1.0 400")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        _, stderr = stop_process(proc)
    events = [json.loads(line) for line in stderr.splitlines()]  # each line one JSON object
    (error,) = [e for e in events if e.get("logger") == "aiohttp.server"]  # three bad requests: logged once
    assert error["level"] == "ERROR" and "exception" in error
    assert value(text, "vllm_capacity_http_errors_total", kind="bad_request") == 3  # and each counted


@pytest.mark.serial  # bounds the time from SIGTERM to exit
async def test_sigterm_stops_at_once_while_a_read_of_vllm_hangs(fake_vllm: FakeVllm) -> None:
    """vLLM takes 6 s to answer and --timeout is 5s: SIGTERM still ends the sidecar at once, exit 0 (it waited out
    the timeout before: 20 s at --timeout 20s)."""

    port = free_port()
    fake_vllm.delay = 6.0
    proc = _serve("--vllm-url", fake_vllm.url, "--listen", f"127.0.0.1:{port}", "--timeout", "5s")
    try:
        for _ in range(100):  # until the read of vLLM is in flight
            await asyncio.sleep(0.1)
            if "/metrics" in fake_vllm.requests:
                break
        assert "/metrics" in fake_vllm.requests
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 10)
        took = time.monotonic() - sent
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    assert took < 2.0, f"exit took {took:.2f}s after SIGTERM (promise: at once, whatever --timeout is)"


def test_durations_take_prometheus_grammar_on_every_flag() -> None:
    """--latency-half-life's help says "1m to 7d" and 7d was refused, as was 1h30m: every duration flag and its env
    twin take Prometheus' grammar now, and the bounds print in it."""
    serve = _resolve(["--latency-half-life", "7d", "--interval", "1m30s", "--models-refresh", "1h30m"], {})
    assert (serve.latency_half_life, serve.interval, serve.models_refresh) == (604800.0, 90.0, 5400.0)
    assert _resolve([], {"VLLM_CAPACITY_LATENCY_HALF_LIFE": "1w"}).latency_half_life == 604800.0
    result = _main("serve", "--latency-half-life", "2w")
    assert result.returncode == 2
    assert result.stderr.strip().endswith("--latency-half-life: '2w' is above the maximum 1w")


def _logged(fmt: str, level: str) -> list[str]:
    """The lines the agent's logging writes in ``fmt`` at ``level``: one of its own events below the level, one
    warning of its own, and one error from aiohttp's server logger (a foreign, standard-library logger)."""
    from vllm_capacity import log

    err = io.StringIO()
    saved, saved_structlog = sys.stderr, structlog.get_config()
    root = stdlib_logging.getLogger()
    saved_root = (root.handlers[:], root.level)
    sys.stderr = err
    try:
        log.configure(fmt, level)
        logger = structlog.get_logger("vllm_capacity")
        logger.info("not_shown")
        logger.warning("source_failed", source="vllm", error="cannot connect to http://127.0.0.1:9/metrics")
        # a message of its own per call: the same foreign error again within a minute is held back (OncePerCause)
        stdlib_logging.getLogger("aiohttp.server").error(f"Error handling request ({fmt}, {level})")
    finally:
        sys.stderr = saved
        structlog.configure(**saved_structlog)
        root.handlers[:], root.level = saved_root
    return err.getvalue().splitlines()


def test_logging_flags_as_prometheus_exporters_spell_them() -> None:
    """--log.level (debug, info, warn, error) and --log.format (logfmt, json), as promslog's exporters take them;
    the older spellings still work. Both formats write promslog's keys first: time (RFC 3339, UTC), level (INFO,
    WARN, ERROR, as Go's slog names them) and msg, for the sidecar's own events and foreign loggers' alike."""
    serve = _resolve(["--log.level", "warn", "--log.format", "logfmt"], {})
    assert (serve.log_level, serve.log_format) == ("warning", "logfmt")
    assert _resolve(["--log-level", "warning", "--log-format", "console"], {}).log_format == "console"
    ours, foreign = _logged("logfmt", "warning")
    assert re.fullmatch(
        r"time=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z level=WARN msg=source_failed source=vllm "
        r'error="cannot connect to http://127.0.0.1:9/metrics"',
        ours,
    ), ours
    assert re.match(r'time=\S+ level=ERROR msg="Error handling request \(logfmt, warning\)" ', foreign), foreign
    lines = [json.loads(line) for line in _logged("json", "warning")]
    assert [list(e)[:3] for e in lines] == [["time", "level", "msg"]] * 2
    assert [(e["level"], e["msg"]) for e in lines] == [
        ("WARN", "source_failed"),
        ("ERROR", "Error handling request (json, warning)"),
    ]
    assert lines[0]["source"] == "vllm" and "event" not in lines[0] and "timestamp" not in lines[0]
    # --log.level debug lets the info event through, as INFO
    assert json.loads(_logged("json", "debug")[0])["level"] == "INFO"


def test_exporter_flags() -> None:
    """--web.max-requests sets the listener's cap; --web.disable-exporter-metrics is a switch, given alone or with a
    value, as exporters take it."""
    serve = _resolve(["--web.max-requests", "64", "--web.disable-exporter-metrics"], {})
    assert (serve.web_max_requests, serve.web_disable_exporter_metrics) == (64, True)
    assert _resolve([], {}).web_max_requests == 512 and not _resolve([], {}).web_disable_exporter_metrics
    assert not _resolve(["--web.disable-exporter-metrics=false"], {}).web_disable_exporter_metrics
    assert _resolve([], {"VLLM_CAPACITY_WEB_DISABLE_EXPORTER_METRICS": "yes"}).web_disable_exporter_metrics
    result = _main("serve", "--web.max-requests", "0")
    assert result.returncode == 2 and "--web.max-requests: '0'" in result.stderr


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether the process has a handler for ``sig`` (its SigCgt mask, /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (sig - 1)))


def _accepts(port: int) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@pytest.mark.serial  # watches a process start in fine steps
async def test_a_sigterm_while_starting_is_a_clean_exit(fake_vllm: FakeVllm) -> None:
    """SIGTERM was handled only once the listener was up: in the first ~0.4 s (the imports) it killed the sidecar
    (rc -15, no stopping line). The handler is now installed before anything slow: it is in place while the
    listener is not up yet, and a SIGTERM then ends the process cleanly."""
    port = free_port()
    proc = _serve("--vllm-url", fake_vllm.url, "--listen", f"127.0.0.1:{port}")
    try:
        for _ in range(5000):
            if _catches(proc.pid, signal.SIGTERM) or proc.poll() is not None:
                break
            await asyncio.sleep(0.001)
        listening = _accepts(port)
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 10)
    finally:
        _, stderr = stop_process(proc)
    assert not listening, "the SIGTERM handler came only with the listener: a SIGTERM before it was rc -15"
    assert proc.returncode == 0, stderr
    assert "stopping" in {json.loads(line)["msg"] for line in stderr.splitlines()}


@pytest.mark.serial  # bounds the time from SIGTERM to exit
async def test_sigterm_stops_within_a_second_whatever_a_client_does(fake_vllm: FakeVllm) -> None:
    """A client asks for megabytes of /metrics and does not read them: the exit waited for it (122 s at 4.7 MB;
    the kubelet kills at 30 s). Requests in flight now get half a second, then their connections are cut."""
    import socket

    from support.payloads import data_parallel

    fake_vllm.metrics = data_parallel(256)
    port = free_port()
    proc = _serve("--vllm-url", fake_vllm.url, "--listen", f"127.0.0.1:{port}", "--max-body-size", "64MiB")
    stuck = socket.socket()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(300):
                await asyncio.sleep(0.1)
                with contextlib.suppress(httpx.TransportError):
                    size = len((await client.get(f"http://127.0.0.1:{port}/metrics")).content)
                    if size > 400 * 1024:
                        break
        assert size > 400 * 1024, f"the sidecar's /metrics is {size} bytes: too small to hold a writer up"
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", port))
        # sixteen requests in a row on the connection (HTTP/1.1 pipelining), read by none: megabytes of answers
        stuck.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 16)
        await asyncio.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, 15)
        took = time.monotonic() - sent
    finally:
        stuck.close()
        _, stderr = stop_process(proc)
    assert proc.returncode == 0, stderr
    assert took < 2.0, f"exit took {took:.2f}s after SIGTERM (promise: within a second, whatever clients do)"


def test_report_text_and_json(fake_vllm_thread: str) -> None:
    text = _main("report", "--vllm-url", fake_vllm_thread)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "capacity" in out and "4,096 tokens" in out and "(32 blocks x 128 tokens)" in out
    assert "max_model_len 1,024" in out and "4.00x" in out
    # 2K/4K/8K exceed the tiny model's 1,024: one note, no rows
    assert out.count("longer than max_model_len") == 1 and "(2,048, 4,096, 8,192:" in out
    assert "bytes per token       unknown" in out  # a block override and no log or model config
    assert "(over 100 %: requests are shorter)" in out  # 16 running, 4 fit at max_model_len
    # 16 running at the capture's --max-num-seqs 16, 8 waiting "for capacity" on a half-empty cache: the agent,
    # not told --max-num-seqs, names no limit (vLLM's "capacity" covers any scheduling limit)
    assert "limit now" not in out
    # ... and never room beside a standing queue: minus the 8 that wait; 16 is what vLLM holds
    assert re.search(r"headroom +-8 requests +\(requests wait: none left\)", out), out
    assert re.search(r"sustained \(held while queued\) +16\.00x", out), out
    assert max(len(line) for line in out.splitlines()) <= 80, "a terminal's 80 columns"
    js = _main("report", "--vllm-url", fake_vllm_thread, "--format", "json")
    doc = json.loads(js.stdout)
    (e,) = doc["engines"]
    assert doc["schema"] == "v1-capacity" and doc["vllm_version"] == "0.32.0"
    assert e["capacity_tokens"] == 4096 and e["max_concurrency"] == 4.0 and e["max_model_len"] == 1024
    assert e["used_tokens"] == pytest.approx(4096 * 16 / 31)
    assert e["running"] == 16 and e["waiting_for_capacity"] == 8
    cache = e["cache_config"]  # typed as JSON types, not the label's text
    assert cache["block_size"] == 128 and cache["enable_prefix_caching"] is True and cache["cache_dtype"] == "auto"
    assert e["concurrency_limit"] is None and e["latency_by_concurrency"] == []
    assert (e["headroom_requests"], e["headroom_basis"]) == (-8, "queue")
    assert e["sustained"] == {"level": 16, "observed": True}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_report_watch_redraws_until_interrupted(fake_vllm_thread: str, sig: signal.Signals, tmp_path: Path) -> None:
    """`report --watch 0.2s` reads again and redraws in place (cursor home, clear) until Ctrl-C or SIGTERM, then
    exits 0, also when started as a shell's background job: `&` starts it with SIGINT ignored (``trap "" INT`` here
    does the same), and Python leaves an ignored SIGINT ignored unless the command installs its own handler. The
    signal goes once it has redrawn three times (its handlers are in place before the first), however slow the
    machine."""
    watch = shlex.join([*VLLM_CAPACITY, "report", "--vllm-url", fake_vllm_thread, "--watch", "0.2s"])
    screen = tmp_path / "screen"
    with screen.open("w") as stdout:
        proc = subprocess.Popen(
            ["sh", "-c", f'trap "" INT; exec {watch}'], stdout=stdout, stderr=subprocess.PIPE, text=True
        )
    try:
        deadline = time.monotonic() + 60
        while screen.read_text().count("(every 0.2s; Ctrl-C to stop)") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        _, err = stop_process(proc, sig)
    out = screen.read_text()
    assert proc.returncode == 0, err
    assert out.count("(every 0.2s; Ctrl-C to stop)") >= 3 and "4,096 tokens" in out, out[:500]
    assert "\x1b[" not in out  # a file is no terminal: frame after frame, no escapes


def test_report_watch_into_a_closed_pipe_ends_quietly(fake_vllm_thread: str) -> None:
    """`report --watch 0.2s | head -3`: the reader goes after three lines; the report ends at its next frame with
    status 0 and nothing on stderr, not a BrokenPipeError traceback."""
    proc = subprocess.Popen([*VLLM_CAPACITY, "report", "--vllm-url", fake_vllm_thread, "--watch", "0.2s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # as head does after its three lines
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert all(lines) and code == 0 and err == "", (code, err)


def test_report_watch_on_a_terminal_redraws_in_place(fake_vllm_thread: str) -> None:
    """On a terminal (a pseudo-terminal here) each frame starts with cursor home and clear."""
    import pty

    primary, secondary = pty.openpty()
    proc = subprocess.Popen([*VLLM_CAPACITY, "report", "--vllm-url", fake_vllm_thread, "--watch", "0.2s"],
                            stdout=secondary, stderr=subprocess.PIPE)  # fmt: skip
    os.close(secondary)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while seen.count(b"\x1b[H\x1b[2J") < 2 and time.monotonic() < deadline:
            seen += os.read(primary, 65536)
    finally:
        stop_process(proc, signal.SIGTERM)
        os.close(primary)
    assert seen.count(b"\x1b[H\x1b[2J") >= 2


def test_the_report_shows_the_learned_curve_and_its_knee() -> None:
    from vllm_capacity.cli.report import render_text
    from vllm_capacity.derive import EngineInputs, LatencyView, derive_engine
    from vllm_capacity.snapshot import Snapshot
    from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

    (m,) = parse_metrics(fixture_text("v1-0.32.0-cpu-saturated.prom")).engines
    view = LatencyView(
        quantiles={("itl", b, q): 0.01 * b * (1 + q) for b in (1, 2, 4, 8) for q in (0.5, 0.9)},
        slo_max_concurrency=4,
        slo_knee_observed=True,
    )
    e = derive_engine(m, EngineInputs(schema="v1-capacity", max_model_len=1024, latency=view))
    out = render_text(Snapshot(up=True, timestamp=0, schema="v1-capacity", engines=(e,)), "http://vllm")
    table = out[out.index("Inter-token latency by running requests") :].splitlines()
    assert table[1].split() == ["running", "p50", "p90", "p99"]
    assert table[2].split() == ["<=", "1", "15.0ms", "19.0ms", "-"]
    assert "<- the objective holds up to here" in table[4] and table[4].split()[1] == "4"
    assert "latency objective" in out and max(len(line) for line in out.splitlines()) <= 80


def test_report_unreachable_vllm() -> None:
    result = _main("report", "--vllm-url", "http://127.0.0.1:9", "--timeout", "1s")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "vllm-capacity report: error: cannot read http://127.0.0.1:9/metrics (connect)"
    ]


TINY = Path(__file__).parent / "fixtures" / "models" / "tiny-llama"


def test_plan_json(tmp_path: Path) -> None:
    result = _main(
        "plan",
        "--model-config",
        str(TINY / "config.json"),
        "--kv-cache-memory",
        "2MiB",
        "--block-size",
        "128",
        "--max-model-len",
        "1024",
        "--vllm-version",
        "0.32.0",
        "--format",
        "json",
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["kv_bytes_per_token"], doc["num_gpu_blocks"], doc["kv_cache_tokens"]) == (512, 32, 4096)
    assert doc["max_concurrency"] == 4.0 and doc["max_model_len"] == 1024
    assert doc["memory_budget"]["kv_cache_bytes"] == 2 * 2**20


def test_plan_text_with_the_whole_budget(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "torch_dtype": "bfloat16",
                "max_position_embeddings": 32768,
            }
        )
    )
    args = (
        "plan",
        "--model-config",
        str(config),
        "--gpu-memory",
        "22.03GiB",
        "--gpu-memory-utilization",
        "0.9",
        "--weights-memory",
        "15.18GiB",
        "--cuda-graph-memory",
        "0.78GiB",
        "--max-model-len",
        "8192",
    )
    result = _main(*args)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in (
        "Model weights",
        "CUDA graphs",
        "KV cache",
        "Outside the budget",
        "bytes per token",
        "128.00 KiB",
        "max concurrency",
        "What would change it",
        # 0.34's extensible cache: an explicit 0.9 caps it, and unset is what vLLM advises
        "gpu_memory_utilization unset (1.0 under the extensible KV cache)",
    ):
        assert expected in out, expected
    older = _main(*args, "--vllm-version", "0.33.0")
    assert older.returncode == 0, older.stderr
    assert "gpu_memory_utilization 0.95" in older.stdout and "Margin kept free" not in older.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-memory", "1GiB"], "give one of --model-config or --model-dir"),
        (["--model-config", "{tiny}"], "give one of --kv-cache-memory"),
        (["--model-config", "{tiny}", "--gpu-memory", "24GiB"], "--gpu-memory needs --weights-memory"),
        (["--model-config", "/nope.json", "--kv-cache-memory", "1GiB"], "--model-config: /nope.json does not exist"),
        (["--model-config", "{tiny}", "--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "1.5"], "not in (0, 1]"),
    ],
)
def test_plan_usage_errors(args: list[str], message: str) -> None:
    args = [a.replace("{tiny}", str(TINY / "config.json")) for a in args]
    result = _main("plan", *args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _sliding_config(tmp_path: Path, **extra: object) -> Path:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "torch_dtype": "bfloat16",
                "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                **extra,
            }
        )
    )
    return config


def test_plan_refuses_what_it_does_not_model(tmp_path: Path) -> None:
    config = _sliding_config(tmp_path, full_attention_interval=2, layer_types=None)  # Qwen3-Next's Gated DeltaNet
    result = _main("plan", "--model-config", str(config), "--kv-cache-memory", "1GiB", "--max-model-len", "4096")
    assert result.returncode == 3  # PLAN_NOT_MODELLED
    assert (
        "not modelled" in result.stderr
        and "no state fields" in result.stderr
        and "linear_num_value_heads" in result.stderr
    )


def test_plan_of_a_sliding_window_hybrid(tmp_path: Path) -> None:
    """The text plan shows vLLM's groups and says what it assumed; the batch size default follows the GPU."""
    config = _sliding_config(tmp_path)
    args = ("plan", "--model-config", str(config), "--max-model-len", "32768", "--weights-memory", "10GiB")
    args += ("--vllm-version", "0.33.0")  # blocks of 16 (0.34's are 64: test_vllm_034.py)
    h100 = _main(*args, "--gpu-memory", "80GiB")
    assert h100.returncode == 0, h100.stderr
    assert "groups                          2   of 2 layers (1 sliding, 1 full)" in h100.stdout
    assert "max_num_batched_tokens 8,192 x 2 batches under async scheduling" in h100.stdout
    small = _main(*args, "--gpu-memory", "24GiB", "--async-scheduling", "off", "--format", "json")
    plan = json.loads(small.stdout)
    sliding = [g for g in plan["groups"] if g["kind"] == "sliding"]
    assert sliding == [{"kind": "sliding", "layers": 2, "blocks_per_request": (128 - 1 + 2048 + 15) // 16 + 1}]
    assert plan["inputs"]["max_num_batched_tokens"] == 2048 and plan["inputs"]["async_scheduling"] is False


def test_serve_rejects_a_config_it_cannot_read(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"num_attention_heads": 8}')
    result = _main("serve", "--model-config", str(config))
    assert result.returncode == 2
    assert "--model-config: num_hidden_layers: missing from config.json" in result.stderr


def test_report_with_the_startup_log_and_model_config(fake_vllm_thread: str) -> None:
    fixtures = Path(__file__).parent / "fixtures"
    result = _main(
        "report",
        "--vllm-url",
        fake_vllm_thread,
        "--vllm-log",
        str(fixtures / "vllm" / "v1-0.32.0-cpu-startup.log"),
        "--model-dir",
        str(TINY),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "512 B   (the log's KV memory / KV tokens)" in out
    assert "512 B   (config.json geometry)" in out
    assert re.search(r"KV cache pool +2\.00 MiB", out)
    assert "Host memory of the CPU server (from vLLM's log)" in out and "GPU" not in out
    assert "max_model_len 1,024" in out and "512.00 KiB" in out  # KV per request of max_model_len tokens
    assert re.search(r"per request +8 blocks   \(full 1 x 8: groups x blocks\)", out)  # the planned layout
    doc = json.loads(
        _main("report", "--vllm-url", fake_vllm_thread, "--model-dir", str(TINY), "--format", "json").stdout
    )
    assert doc["engines"][0]["kv_bytes_per_token_model"] == 512


def _readme_row(opt: options.Option, environment: bool) -> str:
    default = f"`{opt.default}`" if opt.default is not None else "-"
    cells = [f"`{opt.flag}`", *([f"`{opt.env}`"] if environment else []), default, opt.help]
    return "| " + " | ".join(cells) + " |"


@pytest.mark.parametrize(
    ("options", "environment", "document"),
    [(options.SERVE_OPTIONS, True, "README.md"), (options.PLAN_OPTIONS, False, "docs/planning.md")],
)
def test_documented_option_tables_match_the_code(options: tuple, environment: bool, document: str) -> None:
    text = (Path(__file__).parents[1] / document).read_text().splitlines()
    missing = [_readme_row(opt, environment) for opt in options if _readme_row(opt, environment) not in text]
    assert not missing, f"{document} rows out of date:\n" + "\n".join(missing)


def test_the_report_shows_speculative_acceptance_next_to_capacity() -> None:
    from dataclasses import replace

    from vllm_capacity.cli.report import render_text
    from vllm_capacity.cli.report_json import render_json
    from vllm_capacity.derive import EngineInputs, derive_engine
    from vllm_capacity.snapshot import Snapshot
    from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

    (m,) = parse_metrics(fixture_text("v1-0.32.0-cpu-saturated.prom")).engines
    plain = derive_engine(m, EngineInputs(schema="v1-capacity", max_model_len=1024))
    drafted = replace(m, spec_drafts_total=40.0, spec_draft_tokens_total=80.0, spec_accepted_tokens_total=20.0)
    e = derive_engine(drafted, EngineInputs(schema="v1-capacity", max_model_len=1024))
    snap = Snapshot(up=True, timestamp=0, schema="v1-capacity", engines=(e,))
    out = render_text(snap, "http://vllm")
    section = out[out.index("Speculative decoding (since vLLM started)") :].splitlines()
    assert section[1].split()[:3] == ["accepted", "25.0", "%"] and "(20 of 80 draft tokens)" in section[1]
    assert section[2].split()[:4] == ["tokens", "per", "step", "1.50"]
    assert out.index("Speculative decoding") > out.index("Load")  # next to capacity and load
    doc = json.loads(render_json(snap, "http://vllm"))["engines"][0]["spec_decode"]
    assert doc == {"draft_tokens": 80.0, "accepted_tokens": 20.0, "drafts": 40.0, "acceptance_ratio": 0.25,
                   "mean_acceptance_length": 1.5}  # fmt: skip
    plain_out = render_text(Snapshot(up=True, timestamp=0, schema="v1-capacity", engines=(plain,)), "http://vllm")
    assert "Speculative decoding" not in plain_out
    v0 = replace(drafted, spec_drafts_total=None)  # V0 counts no drafts: the length is unknown, not made up
    out0 = render_text(Snapshot(up=True, timestamp=0, schema="v0", engines=(derive_engine(v0,
                       EngineInputs(schema="v0", max_model_len=1024)),)), "http://vllm")  # fmt: skip
    assert "tokens per step       unknown" in out0


def test_the_plan_example_in_docs_planning_is_what_the_command_prints(tmp_path: Path) -> None:
    """docs/planning.md's example: its command (the model's directory as its config and the weights its safetensors
    hold, 14.99 GiB) prints the picture shown, and the classic 0.9 under 0.33's rules the figures the text gives."""
    from support.model_configs import LLAMA_31_8B

    text = (Path(__file__).parents[1] / "docs" / "planning.md").read_text()
    command = text[text.index("vllm-capacity plan --model-dir") : text.index("```", text.index("--model-dir"))]
    args = shlex.split(command.replace("\\\n", " "))[2:]
    at = args.index("--model-dir")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_31_8B))
    args[at : at + 2] = ["--model-config", str(config), "--weights-memory", "14.99GiB"]
    args = args[: args.index("--format")]
    block = text.index("```\n", text.index("```\n", text.index("--format json")) + 4) + 4  # the next block
    shown = text[block : text.index("```", block)].splitlines()
    assert len(shown) > 15
    run = _main("plan", *args)
    assert run.returncode == 0, run.stderr
    printed = run.stdout.splitlines()
    assert [line for line in shown if line not in printed] == []
    classic = _main("plan", *args, "--vllm-version", "0.33.0", "--gpu-memory-utilization", "0.9")
    said = text[text.index("`--vllm-version 0.33.0 --gpu-memory-utilization 0.9`") :].split(":", 1)[0]
    for figure in ("55.31 GiB", "28,318", "of 16 tokens", "453,088", "13.83x"):
        assert figure in classic.stdout and figure.split(" of ")[-1] in said


def test_every_help_screen_groups_its_options_and_shows_examples_that_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command's --help exits 0 (a "%" in a help text once crashed advise --help), shows its options under
    headings by purpose, every option under one, and two or three examples; each example parses and resolves into
    the command's configuration (its files made here)."""
    import bcrypt
    import trustme

    model = Path(__file__).parent / "fixtures" / "models" / "tiny-llama" / "config.json"
    (tmp_path / "llama-3.1-8b").mkdir()
    for target in (tmp_path / "config.json", tmp_path / "llama-3.1-8b" / "config.json"):
        target.write_text(model.read_text())
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    (tmp_path / "token").write_text("t0ken\n")
    (tmp_path / "vllm.log").write_text("")
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  prometheus: {hashed}\n")
    monkeypatch.chdir(tmp_path)
    parser = options.build_parser()
    for command, (groups, epilog) in options.HELP.items():
        with pytest.raises(SystemExit) as done:
            parser.parse_args([command, "--help"])
        assert done.value.code == 0, command
        screen = capsys.readouterr().out
        headings = [title for title, _ in groups]
        assert len(headings) >= 3 and all(f"\n{title}:\n" in screen for title in headings), (command, screen)
        flags = [opt.flag for opt in options.COMMANDS[command][1]]
        assert sorted(f for _, fs in groups for f in fs) == sorted(flags), command
        assert all(screen.index(f"\n{headings[0]}:\n") < screen.index(f"  {flag}") for flag in flags), command
        examples = [
            line.strip() for line in epilog.split("\n\n")[0].replace("\\\n", " ").splitlines()[1:] if line.strip()
        ]
        assert 2 <= len(examples) <= 3, (command, examples)
        for example in examples:
            argv = shlex.split(example, comments=True)
            assert argv[:2] == ["vllm-capacity", command], example
            ns = parser.parse_args(argv[1:])
            assert isinstance(options.config(command, ns, {}), options.COMMANDS[command][0]), example
