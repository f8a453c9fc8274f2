"""The agent against a loopback HTTP server playing vLLM: what is served, what vanishes, what is counted and logged."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
from collections.abc import AsyncIterator

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from support.doubles import FakeClock, FakeVllm
from support.exposition import samples, value
from support.files import VLLM_FIXTURES, fixture_text
from support.payloads import with_value, without_queue
from vllm_capacity.derive.facts import ServedModel, ServerFlags
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.web.app import make_app

DERIVED = (
    "vllm_capacity_kv_cache_capacity_tokens",
    "vllm_capacity_kv_cache_used_tokens",
    "vllm_capacity_kv_cache_free_tokens",
    "vllm_capacity_kv_cache_usage_ratio",
    "vllm_capacity_max_concurrency",
    "vllm_capacity_max_model_len_tokens",
    "vllm_capacity_requests_running",
    "vllm_capacity_preemptions_total",
    "vllm_capacity_vllm_info",
)


class Harness:
    def __init__(self, agent: Agent, client: TestClient) -> None:
        self.agent, self.http = agent, client

    async def scrape(self) -> str:
        resp = await self.http.get("/metrics")
        assert resp.status == 200
        return await resp.text()


async def _harness(url: str, **client_kw: object) -> AsyncIterator[Harness]:
    vllm = VllmClient(url, timeout=client_kw.pop("timeout", 10.0), **client_kw)  # type: ignore[arg-type]
    agent = Agent(vllm, AgentSettings(interval=0.1))
    async with TestClient(TestServer(make_app(agent))) as http:
        yield Harness(agent, http)
    await vllm.aclose()


@pytest.fixture
async def h(fake_vllm: FakeVllm) -> AsyncIterator[Harness]:
    async for harness in _harness(fake_vllm.url):
        yield harness


async def test_derived_series_vanish_while_vllm_fails_and_return(h: Harness, fake_vllm: FakeVllm) -> None:
    await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_up") == 1
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens", model_name="tiny-llama", engine="0") == 4096
    assert value(text, "vllm_capacity_max_concurrency", basis="max_model_len") == 4.0
    assert value(text, "vllm_capacity_max_model_len_tokens") == 1024

    fake_vllm.status = 500
    await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_up") == 0
    assert value(text, "vllm_capacity_source_up", source="vllm") == 0
    assert value(text, "vllm_capacity_source_errors_total", source="vllm", reason="http_5xx") == 1
    for name in DERIVED:
        assert name not in text, f"{name} served while vLLM is failing"

    fake_vllm.status = 200
    await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_up") == 1
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 4096
    assert value(text, "vllm_capacity_source_errors_total", source="vllm", reason="http_5xx") == 1


async def test_the_telemetry_path_moves_metrics(fake_vllm: FakeVllm) -> None:
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=0.1))
    async with TestClient(TestServer(make_app(agent, metrics_path="/capacity/metrics"))) as http:
        await agent.cycle()
        assert (await http.get("/metrics")).status == 404
        assert "vllm_capacity_up 1.0" in await (await http.get("/capacity/metrics")).text()
        assert 'href="capacity/metrics"' in await (await http.get("/")).text()
    await vllm.aclose()


async def test_connection_refused_is_counted() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at once: nothing listens there
    async for h in _harness(f"http://127.0.0.1:{port}"):
        await h.agent.cycle()
        text = await h.scrape()
        assert value(text, "vllm_capacity_source_errors_total", source="vllm", reason="connect") == 1
        assert value(text, "vllm_capacity_up") == 0
        resp = await h.http.get("/readyz")
        assert resp.status == 200  # the sidecar is ready: it tells the truth (up 0); readiness never follows vLLM


async def test_models_without_max_model_len(h: Harness, fake_vllm: FakeVllm) -> None:
    fake_vllm.models = '{"object":"list","data":[{"id":"tiny-llama","object":"model","max_model_len":null}]}'
    with structlog.testing.capture_logs() as logs:
        await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_source_errors_total", source="vllm_models", reason="missing_max_model_len") == 1
    assert value(text, "vllm_capacity_source_up", source="vllm_models") == 0
    assert value(text, "vllm_capacity_up") == 1  # /metrics itself is fine
    # vLLM >= 0.24 still tells max_model_len through kv_cache_size_tokens / kv_cache_max_concurrency
    assert value(text, "vllm_capacity_max_model_len_tokens") == 1024
    assert [e["reason"] for e in logs if e["event"] == "source_failed"] == ["missing_max_model_len"]


async def test_max_model_len_override_used_when_models_unavailable(fake_vllm: FakeVllm) -> None:
    fake_vllm.metrics = fixture_text("v1-0.10.2-dp2.prom")
    fake_vllm.models = "not json"
    vllm = VllmClient(fake_vllm.url, timeout=2)
    agent = Agent(vllm, AgentSettings(interval=0.1, flags=ServerFlags(max_model_len=32768)))
    snap = await agent.cycle()
    await vllm.aclose()
    assert [round(e.max_concurrency, 2) for e in snap.engines] == [1.30, 1.30]
    assert agent.errors[("vllm_models", "parse_error")] == 1


async def test_restart_refetches_models_and_counters_never_go_down(h: Harness, fake_vllm: FakeVllm) -> None:
    saturated = fixture_text("v1-0.32.0-cpu-saturated.prom")
    fake_vllm.metrics = saturated
    await h.agent.cycle()
    assert fake_vllm.requests.count("/v1/models") == 1
    text = await h.scrape()
    assert value(text, "vllm_capacity_preemptions_total") == 82
    await h.agent.cycle()
    assert fake_vllm.requests.count("/v1/models") == 1  # not on every cycle

    # vLLM restarts: new process start time, counters back near zero, smaller max_model_len
    start = value(saturated, "process_start_time_seconds")
    (start_line,) = [ln for ln in saturated.splitlines() if ln.startswith("process_start_time_seconds ")]
    restarted = saturated.replace(start_line, f"process_start_time_seconds {start + 100!r}").replace(
        'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 82.0',
        'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 2.0',
    )
    assert restarted != saturated
    fake_vllm.metrics = restarted
    fake_vllm.models = '{"object":"list","data":[{"id":"tiny-llama","object":"model","max_model_len":512}]}'
    with structlog.testing.capture_logs() as logs:
        await h.agent.cycle()  # the first read of the new process: /v1/models again, the counter held
        assert fake_vllm.requests.count("/v1/models") == 2
        text = await h.scrape()
        assert value(text, "vllm_capacity_max_model_len_tokens") == 512
        assert value(text, "vllm_capacity_preemptions_total") == 82
        await h.agent.cycle()  # the second says the same: a restart, carried exactly
    assert [e["event"] for e in logs].count("vllm_restarted") == 1
    text = await h.scrape()
    assert value(text, "vllm_capacity_preemptions_total") == 84  # 82 before the restart + 2 since


async def test_one_bad_read_poisons_nothing_learned_or_carried(h: Harness, fake_vllm: FakeVllm) -> None:
    """A glitch is not a restart, and a value no engine could have is refused for the counters and the learners: one
    bad process_start_time_seconds added 20 preemptions, a dip in generation tokens 10, a read of 9e15 preemptions
    stayed in the counter for good, a TTFT jump of 1e12 set every quantile to 2,560 s, running 1e12 set the
    sustained concurrency to 2.1e10. Each is left out (counted, logged once); the reads after it go on as before."""
    saturated = fixture_text("v1-0.32.0-cpu-saturated.prom")
    start = value(saturated, "process_start_time_seconds")
    (start_line,) = [ln for ln in saturated.splitlines() if ln.startswith("process_start_time_seconds ")]
    preempt = 'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 82.0'
    lines = saturated.splitlines()
    gen = next(ln for ln in lines if ln.startswith("vllm:generation_tokens_total{"))
    ttft = next(ln for ln in lines if ln.startswith("vllm:time_to_first_token_seconds_bucket{") and 'le="+Inf"' in ln)
    running = next(ln for ln in lines if ln.startswith("vllm:num_requests_running{"))
    glitches = {
        "a new start time for one read": saturated.replace(start_line, f"process_start_time_seconds {start + 100!r}"),
        "a dip in generation tokens": saturated.replace(gen, gen.rsplit(" ", 1)[0] + " 10.0"),
        "9e15 preemptions": saturated.replace(preempt, preempt.replace("82.0", "9e15")),
        "a TTFT jump of 1e12": saturated.replace(ttft, ttft.rsplit(" ", 1)[0] + " 1e12"),
        "running 1e12": saturated.replace(running, running.rsplit(" ", 1)[0] + " 1e12"),
    }  # fmt: skip
    fake_vllm.metrics = saturated
    await h.agent.cycle()
    await h.agent.cycle()
    before = await h.scrape()
    quantiles = {k: v for k, v in samples(before).items() if k[0] == "vllm_capacity_latency_by_concurrency_seconds"}
    sustained = value(before, "vllm_capacity_max_concurrency", basis="sustained")
    for name, glitch in glitches.items():
        assert glitch != saturated, name
        fake_vllm.metrics = glitch
        await h.agent.cycle()
        fake_vllm.metrics = saturated
        await h.agent.cycle()
        text = await h.scrape()
        assert value(text, "vllm_capacity_preemptions_total") == 82, name
        assert {
            k: v for k, v in samples(text).items() if k[0] == "vllm_capacity_latency_by_concurrency_seconds"
        } == quantiles, name
        assert value(text, "vllm_capacity_max_concurrency", basis="sustained") == pytest.approx(sustained, rel=0.01), (
            name
        )
    assert h.agent.counters.glitches == 2  # the start time and the dip: each held one read, then dropped


async def test_models_refetched_after_vllm_comes_back(h: Harness, fake_vllm: FakeVllm) -> None:
    await h.agent.cycle()
    fake_vllm.status = 503
    await h.agent.cycle()
    fake_vllm.status = 200
    await h.agent.cycle()
    assert fake_vllm.requests.count("/v1/models") == 2


async def test_http_endpoints(h: Harness) -> None:
    assert (await h.http.get("/healthz")).status == 200
    assert (await h.http.get("/readyz")).status == 503  # its first read of vLLM has not finished yet
    await h.agent.cycle()
    assert (await h.http.get("/readyz")).status == 200
    page = await (await h.http.get("/")).text()
    assert 'href="metrics"' in page
    om = await h.http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["Content-Type"].startswith("application/openmetrics-text")
    body = await om.text()
    assert body.rstrip().endswith("# EOF")
    assert "# TYPE vllm_capacity_vllm info" in body
    plain = await h.http.get("/metrics")
    assert plain.headers["Content-Type"].startswith("text/plain")
    odd = await h.http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=abc"})
    assert odd.status == 200 and odd.headers["Content-Type"].startswith("text/plain")  # was an HTTP 500


async def test_metrics_answer_gzip_when_the_scraper_asks(h: Harness) -> None:
    """Prometheus sends Accept-Encoding: gzip on every scrape; a 64-engine exposition is ten times smaller so."""
    import gzip

    await h.agent.cycle()
    plain = await h.http.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert "Content-Encoding" not in plain.headers
    zipped = await h.http.get("/metrics", headers={"Accept-Encoding": "gzip"}, auto_decompress=False)
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(await zipped.read()).decode() == await plain.text()


async def test_a_models_list_nested_past_the_parser_is_a_models_failure_not_a_crash(
    h: Harness, fake_vllm: FakeVllm
) -> None:
    """A /v1/models body nested 100,000 deep (json raises RecursionError) is the vllm_models source's parse error:
    the cycle goes on, vLLM's capacity is served, the agent's own source stays up. It was a crash every cycle:
    no derived series while every source_up read 1."""
    fake_vllm.models = "[" * 100_000 + "]" * 100_000
    with structlog.testing.capture_logs() as logs:
        await h.agent.cycle()
    text = await h.scrape()
    assert "cycle_crashed" not in [e["event"] for e in logs]
    assert value(text, "vllm_capacity_source_up", source="vllm_models") == 0
    assert value(text, "vllm_capacity_source_errors_total", source="vllm_models", reason="parse_error") == 1
    assert value(text, "vllm_capacity_source_up", source="agent") == 1
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 4096


async def test_a_large_models_list_is_read_off_the_loop_and_capped(
    h: Harness, fake_vllm: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 14.6 MB /v1/models was parsed on the event loop: 166 MiB and /healthz waiting 473 ms. A list over 128 KiB
    is parsed in the parse thread now, and one over MODELS_MAX_BYTES is a vllm_models failure (body_too_large)
    before it is parsed at all; vLLM's capacity is served either way."""
    import threading

    import vllm_capacity.sources.vllm as vllm_source

    threads: list[bool] = []
    parse = vllm_source.parse_models

    def noted(*args: object) -> object:
        threads.append(threading.current_thread() is threading.main_thread())
        return parse(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(vllm_source, "parse_models", noted)
    adapters = ",".join(f'{{"id":"adapter-{i}","object":"model","parent":"tiny-llama"}}' for i in range(5000))
    fake_vllm.models = (
        '{"object":"list","data":[{"id":"tiny-llama","object":"model","max_model_len":1024},' + adapters + "]}"
    )
    assert 128 * 1024 < len(fake_vllm.models) < vllm_source.MODELS_MAX_BYTES
    await h.agent.cycle()
    assert threads == [False]  # parsed, and not on the loop
    assert value(await h.scrape(), "vllm_capacity_source_up", source="vllm_models") == 1
    h.agent.models.forget()
    fake_vllm.models = fake_vllm.models.replace("]}", "," + ",".join([adapters] * 15) + "]}")
    assert len(fake_vllm.models) > vllm_source.MODELS_MAX_BYTES
    await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_source_errors_total", source="vllm_models", reason="body_too_large") == 1
    assert threads == [False]  # refused before a parse
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 4096


async def test_a_crashing_cycle_does_not_kill_the_loop(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    clock = FakeClock()
    h.agent.monotonic = clock
    stop = asyncio.Event()
    calls = 0

    async def boom() -> None:
        nonlocal calls
        calls += 1
        clock.advance(h.agent.interval)  # each cycle takes a whole interval: the next one starts at once
        if calls == 3:
            stop.set()
        raise RuntimeError("bug")

    monkeypatch.setattr(h.agent, "cycle", boom)
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(h.agent.run(stop), timeout=10)
    assert calls == 3  # the loop went on after each crash, and stopped when told
    (crashed,) = [e for e in logs if e["event"] == "cycle_crashed"]  # one cause, logged once
    assert isinstance(crashed["exc_info"], RuntimeError)  # with its traceback (it was logged outside an except)
    assert h.agent.errors[("agent", "internal")] == 3  # and counted every time
    text = await h.scrape()
    assert value(text, "vllm_capacity_source_errors_total", source="agent", reason="internal") == 3
    assert value(text, "vllm_capacity_source_up", source="agent") == 0  # said where up-level series are read
    assert not h.agent.snapshot.up
    assert (await h.http.get("/healthz")).status == 200
    assert (await h.http.get("/readyz")).status == 200  # serving up 0 is the truth: the pod stays ready


async def test_what_is_not_an_exception_ends_the_loop_and_stop_ends_it_between_reads(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    class Leave(BaseException):  # not an Exception: not a bug to count, it goes up (as GeneratorExit would)
        pass

    async def leave() -> None:
        raise Leave

    monkeypatch.setattr(h.agent, "cycle", leave)
    with pytest.raises(Leave):
        await asyncio.wait_for(h.agent.run(asyncio.Event()), timeout=10)
    calls = 0

    async def count() -> None:
        nonlocal calls
        calls += 1

    monkeypatch.setattr(h.agent, "cycle", count)
    h.agent.interval = 3600.0  # the loop sleeps between reads: stop ends the sleep at once
    stop = asyncio.Event()
    run = asyncio.ensure_future(h.agent.run(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(run, timeout=5)
    assert calls == 1


async def test_log_source_failures_leave_vllm_metrics_flowing(fake_vllm: FakeVllm, tmp_path) -> None:
    from vllm_capacity.sources.vllm_log import LogFollower

    log = tmp_path / "vllm.log"
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=0.1), vllm_log=LogFollower(log))
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
        await agent.cycle()
    assert agent.sources["vllm_log"].up is False
    assert agent.errors[("vllm_log", "missing")] == 2
    assert [e["reason"] for e in logs if e["event"] == "source_failed"] == ["missing"]
    assert agent.snapshot.up and agent.snapshot.engines[0].capacity_tokens == 4096
    log.write_text((VLLM_FIXTURES / "v1-0.32.0-cpu-startup.log").read_text())
    snap = await agent.cycle()
    assert agent.sources["vllm_log"].up is True
    assert snap.engines[0].kv_bytes_per_token_startup_log == 512
    await vllm.aclose()


async def test_a_log_line_that_cannot_be_right_is_counted_and_logged_once(fake_vllm: FakeVllm, tmp_path) -> None:
    from vllm_capacity.sources.vllm_log import LogFollower

    log = tmp_path / "vllm.log"
    huge = "(EngineCore_DP0 pid=1) INFO 11-02 10:00:00 [gpu_model_runner.py:3000] Model loading took " + "9" * 400
    log.write_text(huge + ".0 GiB memory\n")
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=0.1), vllm_log=LogFollower(log))
    with structlog.testing.capture_logs() as logs:
        snap = await agent.cycle()
        with log.open("a") as f:
            f.write(huge + ".5 GiB memory\n")
        await agent.cycle()
    assert agent.errors[("vllm_log", "implausible_value")] == 2 and agent.sources["vllm_log"].up
    assert [e["families"] for e in logs if e["event"] == "implausible_values"] == [["vllm_log_figures"]]
    assert snap.up and snap.engines[0].weights_bytes is None
    await vllm.aclose()


async def test_a_log_read_that_hangs_never_holds_the_reads_of_vllm(fake_vllm: FakeVllm, tmp_path) -> None:
    """The log on a volume that hangs (a FIFO nobody writes: open() blocks) held every cycle: vLLM read zero times in
    5 s while /metrics said up 1. The read is abandoned at --timeout, counted and logged as a timeout, the log's
    source_up says 0, and vLLM is read every cycle all the same."""
    import os
    import time

    from vllm_capacity.sources.vllm_log import LogFollower

    fifo = tmp_path / "vllm.log"
    os.mkfifo(fifo)
    vllm = VllmClient(fake_vllm.url, timeout=0.3)
    agent = Agent(vllm, AgentSettings(interval=0.1), vllm_log=LogFollower(fifo))
    t0 = time.monotonic()
    try:
        for _ in range(3):
            snap = await agent.cycle()
            assert snap.up and snap.engines[0].capacity_tokens == 4096
        assert time.monotonic() - t0 < 3  # one abandoned read (0.3 s), then no wait at all
        assert agent.sources["vllm_log"].up is False and agent.sources["vllm"].up is True
        assert agent.errors[("vllm_log", "timeout")] == 3
    finally:
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the blocked open() returns; its read sees the end
        os.close(writer)
        await vllm.aclose()


async def test_disagreeing_bytes_per_token_is_logged_once(fake_vllm: FakeVllm) -> None:
    from vllm_capacity.sources.model_config import parse_config
    from vllm_capacity.sources.vllm_log import LogFollower

    wrong = parse_config(
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "torch_dtype": "bfloat16",
        }
    )  # twice the layers the server has
    # the server's 4,096 tokens from a 2 MiB budget (no block override), as the demo's server reports them
    for old, new in (('num_gpu_blocks_override="32"', '"None"'), ('kv_cache_memory_bytes="1073741824"', '"2097152"')):
        fake_vllm.metrics = fake_vllm.metrics.replace(old, old.split("=")[0] + "=" + new)
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(
        vllm,
        AgentSettings(interval=0.1, model=ServedModel(wrong)),
        vllm_log=LogFollower(VLLM_FIXTURES / "v1-0.32.0-cpu-startup.log"),
    )
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            await agent.cycle()
    warnings = [e for e in logs if e["event"] == "bytes_per_token_disagree"]
    assert len(warnings) == 1
    assert (warnings[0]["model_config"], warnings[0]["startup_log"]) == (1024, 512)
    # the planned layout disagrees with vLLM's capacity too: flagged on the engine, logged once with the assumptions
    (e,) = agent.snapshot.engines
    assert e.layout is not None and e.layout.mismatch is True and e.layout.planned_tokens < e.capacity_tokens
    (plan_warning,) = [w for w in logs if w["event"] == "plan_disagrees"]
    assert plan_warning["vllm_tokens"] == e.capacity_tokens and "async scheduling off" in plan_warning["assumed"]
    await vllm.aclose()


async def test_every_read_derives_every_engine_again(fake_vllm: FakeVllm, monkeypatch: pytest.MonkeyPatch) -> None:
    """No read hands back an earlier read's engine: idle, moved or saturated, each read derives each engine, and
    the engines are those ``derive_all`` gives for that read. Under a queue the sustained level is the mean of the
    levels held: 16, 16, 17, 17 is 16.5."""
    from vllm_capacity.derive import engine as derive_engine

    derived: list[str] = []
    real = derive_engine.derive_engine
    monkeypatch.setattr(derive_engine, "derive_engine", lambda *args: derived.append(args[0].engine) or real(*args))
    agent = Agent(VllmClient(fake_vllm.url, timeout=10), AgentSettings(interval=0.1), monotonic=FakeClock())
    idle, saturated = fake_vllm.metrics, fixture_text("v1-0.32.0-cpu-saturated.prom")  # 0 and 16 running
    running_17 = with_value(saturated, "vllm:num_requests_running", "17.0")
    for body in (idle, idle, saturated, saturated, running_17, running_17):
        fake_vllm.metrics = body
        count = len(derived)
        await agent.cycle()
        assert len(derived) == count + 1
    (engine,) = agent.snapshot.engines
    assert engine.sustained is not None and (engine.sustained.level, engine.sustained.observed) == (
        pytest.approx(16.5),
        True,
    )
    await agent.client.aclose()


async def test_v1_0_8_capacity_comes_from_the_log(fake_vllm: FakeVllm, tmp_path) -> None:
    """vLLM 0.8.x reports num_gpu_blocks="None": the startup log's 'GPU KV cache size' fills the gap."""
    from vllm_capacity.sources.vllm_log import LogFollower

    fake_vllm.metrics = fixture_text("v1-0.8.5-legacy.prom")
    fake_vllm.models = '{"data":[{"id":"Qwen/Qwen2.5-7B-Instruct","max_model_len":32768}]}'
    log = tmp_path / "vllm.log"
    log.write_text(
        "(EngineCore_0 pid=7) INFO 04-30 10:00:00 [kv_cache_utils.py:634] GPU KV cache size: 452,000 tokens\n"
        "(EngineCore_0 pid=7) INFO 04-30 10:00:00 [kv_cache_utils.py:637] Maximum concurrency for 32,768 tokens "
        "per request: 13.79x\n"
    )
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=0.1), vllm_log=LogFollower(log))
    (e,) = (await agent.cycle()).engines
    assert e.capacity_tokens == 452000
    assert e.max_concurrency == 13.79
    assert e.used_tokens == 0.125 * 452000
    await vllm.aclose()


async def test_a_figure_the_log_gives_later_reaches_an_unchanged_read(fake_vllm: FakeVllm, tmp_path) -> None:
    """The start-up figures are filled in place as the log is read: an engine whose /metrics did not move (the same
    record, read after read) is derived again when they change, never kept from before them."""
    from vllm_capacity.sources.vllm_log import LogFollower

    fake_vllm.metrics = fixture_text("v1-0.8.5-legacy.prom")  # num_gpu_blocks="None": the capacity is the log's
    fake_vllm.models = '{"data":[{"id":"Qwen/Qwen2.5-7B-Instruct","max_model_len":32768}]}'
    log = tmp_path / "vllm.log"
    log.write_text(
        "(EngineCore_0 pid=7) INFO 04-30 10:00:00 [kv_cache_utils.py:637] Maximum concurrency for 32,768 tokens "
        "per request: 13.79x\n"
    )  # the engine's figures begin: the record the next line fills in
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=0.1), vllm_log=LogFollower(log), monotonic=FakeClock())
    for _ in range(3):  # the first read with the latency histograms, then two alike
        (e,) = (await agent.cycle()).engines
        assert e.capacity_tokens is None and e.max_concurrency == 13.79
    with log.open("a") as f:
        f.write("(EngineCore_0 pid=7) INFO 04-30 10:00:01 [kv_cache_utils.py:634] GPU KV cache size: 452,000 tokens\n")
    (e,) = (await agent.cycle()).engines
    assert e.capacity_tokens == 452000
    await vllm.aclose()


async def test_no_secret_reaches_a_log_line_an_endpoint_or_an_error(fake_vllm: FakeVllm) -> None:
    """A password in --vllm-url and an API key with a UTF-8 byte-order mark before it (as a key file saved by some
    editors gave; the command line now refuses such a file): neither appears in any log line, error message,
    /metrics or the landing page, through a failing /metrics, a /v1/models read with that key, and a recovery."""
    password, key = "pw-very-secret", "\ufeffsk-secret"
    url = fake_vllm.url.replace("http://", f"http://scraper:{password}@")
    client = VllmClient(url, timeout=10, api_key=key)
    agent = Agent(client, AgentSettings(interval=0.1))
    seen: list[str] = []
    async with TestClient(TestServer(make_app(agent))) as http:
        with structlog.testing.capture_logs() as logs:
            fake_vllm.status = 500
            await agent.cycle()
            seen.append(await (await http.get("/")).text())
            fake_vllm.status = 200
            await agent.cycle()  # /metrics answers (basic auth), and /v1/models (the key)
            seen.append(await (await http.get("/metrics")).text())
            seen.append(await (await http.get("/")).text())
    await client.aclose()
    seen += [repr(e) for e in logs]
    assert agent.errors[("vllm", "http_5xx")] == 1
    assert agent.errors[("agent", "internal")] == 0  # no crashed cycle, whatever the key
    assert "***@127.0.0.1" in seen[0]  # the landing page names the server, without its userinfo
    for text in seen:
        assert password not in text and "sk-secret" not in text, text


SATURATED = fixture_text("v1-0.32.0-cpu-saturated.prom")


async def test_exported_counters_never_go_down_double_count_or_become_infinite(h: Harness, fake_vllm: FakeVllm) -> None:
    """vLLM's preemption counter reads 82, -5, 82, 1e300, 90, 1.7e308, 1e308, 95 (no restart): the export is 82,
    absent, 82, absent, 90, absent, absent, 95."""
    exported = []
    for raw in ("82", "-5", "82", "1e300", "90", "1.7e308", "1e308", "95"):
        fake_vllm.metrics = with_value(SATURATED, "vllm:num_preemptions_total", raw)
        await h.agent.cycle()
        exported.append(value(await h.scrape(), "vllm_capacity_preemptions_total"))
    assert exported == [82, None, 82, None, 90, None, None, 95]


async def test_a_flapping_or_reformatted_info_family_is_no_restart(h: Harness, fake_vllm: FakeVllm) -> None:
    """cache_config_info missing on alternate scrapes, or one label re-formatted: no restart, so vLLM's counter is
    not added again (82 once became 1,230 in 18 scrapes)."""
    without = "\n".join(ln for ln in SATURATED.splitlines() if not ln.startswith("vllm:cache_config_info")) + "\n"
    reformatted = SATURATED.replace('gpu_memory_utilization="0.92"', 'gpu_memory_utilization="0.920"')
    assert reformatted != SATURATED
    with structlog.testing.capture_logs() as logs:
        for body in (SATURATED, without, SATURATED, reformatted, SATURATED, without) * 3:
            fake_vllm.metrics = body
            await h.agent.cycle()
            assert value(await h.scrape(), "vllm_capacity_preemptions_total") == 82
    assert not [e for e in logs if e["event"] == "vllm_restarted"]


async def test_a_nan_usage_keeps_the_generation_of_names(h: Harness, fake_vllm: FakeVllm) -> None:
    """vLLM 0.32 sending NaN usage is still the v1-capacity generation (it was taken for v1-legacy)."""
    fake_vllm.metrics = with_value(SATURATED, "vllm:kv_cache_usage_perc", "NaN")
    await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_vllm_info", schema="v1-capacity") == 1
    assert "vllm_capacity_kv_cache_usage_ratio{" not in text
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 4096


async def test_a_thousand_engines_make_short_log_lines(h: Harness, fake_vllm: FakeVllm) -> None:
    """Every engine is served, but a log line names the first few and counts the rest (5,000 engines once made
    one 250 KB line, which log pipelines cut at 16 KB)."""
    lines = [f'vllm:num_requests_running{{engine="{i}",model_name="m"}} 1' for i in range(1000)]
    fake_vllm.metrics = "\n".join(lines) + "\n"
    fake_vllm.models = '{"object":"list","data":[{"id":"m","object":"model","max_model_len":1024}]}'
    with structlog.testing.capture_logs() as logs:
        await h.agent.cycle()
    assert len(h.agent.snapshot.engines) == 1000
    (found,) = [e for e in logs if e["event"] == "vllm_discovered"]
    assert found["engine_count"] == 1000 and found["engines"][-1] == "... 992 more"
    (unknown,) = [e for e in logs if e["event"] == "capacity_unknown"]
    assert unknown["engine_count"] == 1000
    assert max(len(repr(e)) for e in logs) < 2000


def test_an_error_without_a_message_is_named_by_its_cause() -> None:
    """A client error for a reset connection may have no message ('ReadError: ' in the log); the cause says what."""
    import aiohttp

    from vllm_capacity.sources.vllm import _cause

    reset = aiohttp.ClientOSError()
    reset.__cause__ = ConnectionResetError(104, "Connection reset by peer")
    assert _cause(reset) == "ClientOSError: [Errno 104] Connection reset by peer"
    assert _cause(aiohttp.ClientOSError()) == "ClientOSError (no detail: the connection was closed or reset)"


async def test_a_flapping_source_logs_at_a_bounded_rate(fake_vllm: FakeVllm) -> None:
    """vLLM failing every other cycle at 100 ms: one line when it first fails, then at most one line every 10 s,
    saying the state it is in and how many changes came between; every failure is still counted."""
    clock = FakeClock()
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=0.1), monotonic=clock)
    with structlog.testing.capture_logs() as logs:
        for i in range(200):  # 20 s of flapping
            fake_vllm.status = 500 if i % 2 == 0 else 200
            await agent.cycle()
            clock.advance(0.1)
        fake_vllm.status = 200  # and then it stays up
        for _ in range(110):
            await agent.cycle()
            clock.advance(0.1)
    await vllm.aclose()
    events = ("source_failed", "source_recovered", "source_flapping")
    lines = [e for e in logs if e["event"] in events and e["source"] == "vllm"]
    assert agent.errors[("vllm", "http_5xx")] == 100
    assert 2 <= len(lines) <= 4, lines  # 31 s: a line at the start, then one per 10 s at the most
    assert lines[0]["event"] == "source_failed" and "changes_since_last_line" not in lines[0]
    assert any(e.get("changes_since_last_line", 0) > 50 for e in lines)
    assert lines[-1]["event"] == "source_recovered"  # the log ends saying the state it is in


async def test_credentials_in_the_url_and_an_api_key_work_together(fake_vllm: FakeVllm) -> None:
    """Basic credentials in --vllm-url (a proxy's) go with /metrics, vLLM's API key with /v1/*: a request carries
    one Authorization header, and aiohttp refused a request with both, so /v1/models was never read and the sizing
    fell back to the oldest rules."""
    import base64

    url = fake_vllm.url.replace("http://", "http://scraper:p%40ss@")
    vllm = VllmClient(url, timeout=10, api_key="sk-key")
    agent = Agent(vllm, AgentSettings(interval=0.1))
    await agent.cycle()
    await vllm.aclose()
    assert fake_vllm.authorization["/metrics"] == "Basic " + base64.b64encode(b"scraper:p@ss").decode()
    assert fake_vllm.authorization["/v1/models"] == "Bearer sk-key"
    assert agent.sources["vllm_models"].up and agent.snapshot.engines[0].max_model_len == 1024


async def test_a_schema_that_flips_is_announced_once_in_each_shape(h: Harness, fake_vllm: FakeVllm) -> None:
    """A server whose answers flip between two shapes every read (a family that comes and goes) was announced on
    every read: once in each shape now."""
    v1 = SATURATED
    legacy = SATURATED.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    with structlog.testing.capture_logs() as logs:
        for i in range(20):
            fake_vllm.metrics = v1 if i % 2 == 0 else legacy
            await h.agent.cycle()
    schemas = [e["schema"] for e in logs if e["event"] == "vllm_discovered"]
    assert len(schemas) == 2 and len(set(schemas)) == 2, schemas


async def test_every_new_cause_reaches_the_log_whatever_the_rate_limit(fake_vllm: FakeVllm) -> None:
    """503 for a second, then a body that is not vLLM's for five: the second cause came inside the first line's
    10 s and its 25 failures never reached the log. A reason the log has not given is said at once; one it has
    given waits for the rate limit."""
    clock = FakeClock()
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=0.2), monotonic=clock)
    with structlog.testing.capture_logs() as logs:
        for status, body, cycles in ((503, None, 5), (200, "# HELP up Up.\nup 1\n", 25), (503, None, 5)):
            fake_vllm.status = status
            if body is not None:
                fake_vllm.metrics = body
            for _ in range(cycles):
                await agent.cycle()
                clock.advance(0.2)
    await vllm.aclose()
    failed = [e["reason"] for e in logs if e["event"] == "source_failed" and e["source"] == "vllm"]
    assert agent.errors[("vllm", "not_vllm")] == 25
    assert failed == ["http_5xx", "not_vllm"], failed  # the second 503 stretch waits: the log has said http_5xx


async def test_scrapers_of_one_snapshot_share_one_render_per_format(
    fake_vllm: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten scrapers at once cost one render per exposition format; a new snapshot is rendered afresh."""
    import asyncio

    from vllm_capacity.exposition.render import HealthCollector

    renders = 0
    collect = HealthCollector.collect  # in every render (the engines' part may be kept from the last snapshot's)

    def counted(self: HealthCollector):  # type: ignore[no-untyped-def]
        nonlocal renders
        renders += 1
        yield from collect(self)

    monkeypatch.setattr(HealthCollector, "collect", counted)
    async for h in _harness(fake_vllm.url):
        await h.agent.cycle()
        openmetrics = {"Accept": "application/openmetrics-text; version=1.0.0"}
        texts = await asyncio.gather(*(h.http.get("/metrics", headers=openmetrics if i % 2 else {}) for i in range(10)))
        bodies = {await r.text() for r in texts}
        assert renders == 2  # one text, one OpenMetrics
        assert sorted(b.endswith("# EOF\n") for b in bodies) == [False, True]
        await h.scrape()
        assert renders == 2  # still the same snapshot
        await h.agent.cycle()  # a new snapshot
        assert value(await h.scrape(), "vllm_capacity_up") == 1
        assert renders == 3


ITL_LE = re.compile(
    r'^(vllm:inter_token_latency_seconds_bucket\{engine="0",le="([^"]+)",model_name="tiny-llama"\}) \S+$', re.M
)


def _itl_body(running: int, counts: dict[str, float]) -> str:
    """The saturated capture with ``running`` requests, nothing waiting, and the inter-token latency buckets set to
    ``counts``."""
    body = with_value(without_queue(SATURATED), "vllm:num_requests_running", str(running))
    return ITL_LE.sub(lambda m: f"{m[1]} {counts[m[2]]}", body)


async def test_the_latency_curve_and_the_concurrency_an_objective_allows(fake_vllm: FakeVllm) -> None:
    """A server whose inter-token latency is 20 ms up to 4 running requests, 40 ms at 8 and 100 ms at 16, read every
    5 s; with --slo-itl p90<=50ms the agent finds 8 (the knee seen at 16), and at 16 running the objective binds the
    headroom (negative: over the objective)."""
    from vllm_capacity.derive.latency_curve import parse_objective

    les = ITL_LE.findall(SATURATED)
    counts = {le: 0.0 for _, le in les}
    clock = FakeClock()
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=5, objectives=(parse_objective("itl", "p90<=50ms"),)), monotonic=clock)
    async with TestClient(TestServer(make_app(agent))) as http:
        fake_vllm.metrics = _itl_body(1, counts)
        await agent.cycle()  # the baseline
        for running, latency in ((1, 0.02), (2, 0.02), (4, 0.02), (8, 0.04), (16, 0.1)):
            for _ in range(3):
                for le in counts:
                    counts[le] += 200.0 if float(le) >= latency else 0.0
                fake_vllm.metrics = _itl_body(running, counts)
                clock.advance(5)
                await agent.cycle()
        text = await (await http.get("/metrics")).text()
    await vllm.aclose()
    p90 = {
        int(dict(labels)["running"]): v
        for (name, labels), v in samples(text).items()
        if name == "vllm_capacity_latency_by_concurrency_seconds" and dict(labels)["percentile"] == "p90"
    }
    assert set(p90) == {1, 2, 4, 8, 16}
    assert p90[1] == p90[4] < p90[8] < 0.05 < p90[16]
    assert value(text, "vllm_capacity_max_concurrency", basis="slo") == 8
    assert value(text, "vllm_capacity_slo_knee_observed") == 1
    assert value(text, "vllm_capacity_concurrency_utilization_ratio", basis="slo") == 2.0
    assert value(text, "vllm_capacity_headroom_requests", basis="slo") == -8
    # 600 observations at 16, the earliest of them aged 10 s of a 1 h half-life
    observed = value(text, "vllm_capacity_latency_by_concurrency_observations", latency="itl", running="16")
    assert observed == pytest.approx(600 * 0.5 ** (10 / 3600), rel=1e-3)
    assert 'latency="ttft"' not in text  # its histogram did not move: nothing learned


async def test_headroom_follows_the_queue_and_the_sustained_concurrency(h: Harness, fake_vllm: FakeVllm) -> None:
    """vLLM's saturated capture (16 running, 8 waiting for capacity, the cache half used): no headroom, minus the
    queue, and 16 is what vLLM holds. Once calm at 10 running, the sustained 16 binds: 6 more requests, not the 19
    the observed context promises. A restart of vLLM forgets it."""
    fake_vllm.metrics = SATURATED
    await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_headroom_requests", basis="queue") == -8
    assert value(text, "vllm_capacity_max_concurrency", basis="sustained") == 16
    assert value(text, "vllm_capacity_sustained_queue_observed") == 1
    fake_vllm.metrics = with_value(without_queue(SATURATED), "vllm:num_requests_running", "10")
    await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_max_concurrency", basis="observed_context") > 16
    assert value(text, "vllm_capacity_headroom_requests", basis="sustained") == 6
    assert value(text, "vllm_capacity_concurrency_utilization_ratio", basis="sustained") == 10 / 16
    restarted = fake_vllm.metrics.replace(  # a new vLLM process, with no preemption yet
        "process_start_time_seconds 1.79594884689e+09", "process_start_time_seconds 1.9e+09"
    )
    fake_vllm.metrics = with_value(restarted, "vllm:num_preemptions_total", "0.0")
    await h.agent.cycle()
    await h.agent.cycle()  # the second read of the new process confirms the restart
    text = await h.scrape()
    assert value(text, "vllm_capacity_sustained_queue_observed") == 0  # forgotten: 10 running is a lower bound
    assert value(text, "vllm_capacity_max_concurrency", basis="sustained") == 10
    assert value(text, "vllm_capacity_headroom_requests", basis="sustained") is None


def _steps_body(counts: dict[str, float], tokens: float) -> str:
    """The saturated capture (8 waiting for capacity, the cache half used) with vllm:iteration_tokens_total's
    cumulative buckets set to ``counts`` by upper bound and its sum to ``tokens``."""
    text = re.sub(
        r'^(vllm:iteration_tokens_total_bucket\{engine="0",le="([^"]+)",model_name="tiny-llama"\}) \S+$',
        lambda m: f"{m[1]} {counts[m[2]]}",
        SATURATED,
        flags=re.M,
    )
    return re.sub(r"^(vllm:iteration_tokens_total_sum\{[^}]*\}) \S+$", lambda m: f"{m[1]} {tokens}", text, flags=re.M)


async def test_a_full_token_budget_per_step_is_named_as_the_limit(fake_vllm: FakeVllm) -> None:
    """Requests wait for capacity on a half-used cache while the engine's steps are as large as the scheduler's
    --max-num-batched-tokens (256) allows: the token budget binds. Before the agent knows the budget, or while steps
    are small, it names nothing (vLLM's "capacity" covers any scheduling limit). The steps' size is their mean from
    the histogram's sum: under chunked prefill most steps look small in the buckets (a prompt is observed at once
    when its prefill ends), as in the first window here."""
    les = re.findall(r'^vllm:iteration_tokens_total_bucket\{engine="0",le="([^"]+)"', SATURATED, re.M)
    assert re.search(r"^vllm:iteration_tokens_total_sum\{", SATURATED, re.M)
    counts = dict.fromkeys(les, 0.0)
    total = [0.0]
    clock = FakeClock()

    async def limit_after(agent: Agent, lumps: float, tokens: float) -> str | None:
        fake_vllm.metrics = _steps_body(counts, total[0])
        await agent.cycle()
        for le in les:  # 100 more steps: ``lumps`` of them observed at 700 tokens, the rest at 1
            counts[le] += 100.0 if (le == "+Inf" or float(le) >= 700) else (100.0 - lumps if float(le) >= 1 else 0)
        total[0] += tokens
        fake_vllm.metrics = _steps_body(counts, total[0])
        clock.advance(5)
        await agent.cycle()
        return agent.snapshot.engines[0].concurrency_limit

    vllm = VllmClient(fake_vllm.url, timeout=10)
    told = Agent(vllm, AgentSettings(interval=5, flags=ServerFlags(max_num_batched_tokens=256)), monotonic=clock)
    assert await limit_after(told, 36, 36 * 700 + 64) == "token_budget"  # 253 tokens a step
    assert told.snapshot.engines[0].token_budget_fill_ratio == pytest.approx((36 * 700 + 64) / 100 / 256)
    assert await limit_after(told, 1, 700 + 99) is None  # small steps: the budget is not what binds
    assert told.snapshot.engines[0].token_budget_fill_ratio == pytest.approx(799 / 100 / 256)
    untold = Agent(vllm, AgentSettings(interval=5), monotonic=clock)
    assert await limit_after(untold, 36, 36 * 700 + 64) is None
    assert untold.snapshot.engines[0].token_budget_fill_ratio is None
    await vllm.aclose()


async def test_an_engine_asleep_serves_no_capacity(h: Harness, fake_vllm: FakeVllm) -> None:
    """vLLM's sleep mode frees the KV cache: engine_asleep says so, free tokens read 0, no headroom or limit."""
    fake_vllm.metrics = SATURATED
    await h.agent.cycle()
    awake = await h.scrape()
    assert value(awake, "vllm_capacity_engine_asleep") == 0
    assert value(awake, "vllm_capacity_headroom_requests", basis="queue") == -8  # 8 wait for capacity
    asleep = re.sub(r'(sleep_state="awake"\}) 1\.0', r"\1 0.0", SATURATED)
    asleep = re.sub(r'(sleep_state="discard_all"\}) 0\.0', r"\1 1.0", asleep)
    assert 'sleep_state="discard_all"} 1.0' in asleep
    fake_vllm.metrics = asleep
    await h.agent.cycle()
    text = await h.scrape()
    assert value(text, "vllm_capacity_engine_asleep") == 1
    assert value(text, "vllm_capacity_kv_cache_free_tokens") == 0
    assert "vllm_capacity_headroom_requests{" not in text
    assert "vllm_capacity_concurrency_limit{" not in text
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 4096  # what it has when awake


async def test_an_objective_below_the_first_bucket_is_named_once(fake_vllm: FakeVllm) -> None:
    """vLLM's inter-token histogram starts at 10 ms: p90<=5ms cannot be resolved from it, and the agent says so, once
    (with the bucket), while p90<=50ms, which it can resolve, is never named."""
    from vllm_capacity.derive.latency_curve import parse_objective

    clock = FakeClock()
    vllm = VllmClient(fake_vllm.url, timeout=10)
    objectives = (parse_objective("itl", "p90<=5ms"), parse_objective("ttft", "p90<=50ms"))
    agent = Agent(vllm, AgentSettings(interval=5, objectives=objectives), monotonic=clock)
    fake_vllm.metrics = SATURATED
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            await agent.cycle()
            clock.advance(5)
    await vllm.aclose()
    named = [e for e in logs if e["event"] == "slo_objective_below_histogram_resolution"]
    assert [(e["objective"], e["first_bucket_seconds"], e["log_level"]) for e in named] == [
        ("itl p90<=5ms", 0.01, "warning")
    ]


async def test_a_failed_latency_read_keeps_the_latency_schedule(fake_vllm: FakeVllm) -> None:
    """The latency histograms are most of a large server's lines, so the read with them is the one that fails
    (a timeout, a cap): it was retried every cycle, its schedule moving only on success. It keeps its
    LATENCY_EVERY now, failed or not; the cycles between read without them."""
    from vllm_capacity.live.latency import LATENCY_EVERY

    clock = FakeClock()
    vllm = VllmClient(fake_vllm.url, timeout=10.0)
    asked: list[bool] = []
    fetch = vllm.fetch_metrics

    async def noted(*, latency: bool = True) -> object:
        asked.append(latency)
        return await fetch(latency=latency)

    vllm.fetch_metrics = noted  # type: ignore[method-assign]
    agent = Agent(vllm, AgentSettings(interval=0.1), monotonic=clock)
    fake_vllm.status = 503
    for _ in range(3):
        await agent.cycle()
        clock.advance(1.0)
    assert asked == [True, False, False]
    clock.advance(LATENCY_EVERY)
    fake_vllm.status, fake_vllm.metrics = 200, SATURATED
    await agent.cycle()
    await agent.cycle()
    assert asked[3:] == [True, False]
    await vllm.aclose()


async def test_a_render_past_the_scrape_timeout_is_a_503(
    h: Harness, fake_vllm: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prometheus sends X-Prometheus-Scrape-Timeout-Seconds: a render that cannot finish within it (less half a
    second for the answer to travel) is answered 503 at the deadline, not into a scrape Prometheus has dropped."""
    import asyncio
    import time

    from vllm_capacity.exposition.render import RenderCache

    await h.agent.cycle()
    body = RenderCache.body

    async def slow(self: RenderCache, accept: str | None) -> tuple[bytes, str]:
        await asyncio.sleep(3)
        return await body(self, accept)

    monkeypatch.setattr(RenderCache, "body", slow)
    t0 = time.monotonic()
    resp = await h.http.get("/metrics", headers={"X-Prometheus-Scrape-Timeout-Seconds": "1.5"})
    assert resp.status == 503 and "scrape timeout" in await resp.text()
    assert time.monotonic() - t0 < 2.5
    # no header, or one that is not a positive number: no deadline
    monkeypatch.setattr(RenderCache, "body", body)
    for header in ({}, {"X-Prometheus-Scrape-Timeout-Seconds": "soon"}, {"X-Prometheus-Scrape-Timeout-Seconds": "0"}):
        assert (await h.http.get("/metrics", headers=header)).status == 200


async def test_a_small_snapshot_renders_on_the_loop_a_large_one_in_the_worker_thread() -> None:
    """One engine's render (~0.2 ms) costs less than the hand-off to the render thread and back, so a snapshot of up
    to INLINE_RENDER_ENGINES engines renders on the event loop; a larger one in the worker thread, which keeps a long
    encoding off the loop. Either way a snapshot renders once, and a render that failed is tried again."""
    import threading
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily

    from support.payloads import data_parallel
    from vllm_capacity.derive import derive_all
    from vllm_capacity.exposition.render import INLINE_RENDER_ENGINES, RenderCache
    from vllm_capacity.snapshot import Snapshot
    from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

    threads: list[str] = []
    failing = [True]

    class Recorder:
        def collect(self) -> list[GaugeMetricFamily]:
            threads.append(threading.current_thread().name)
            if failing[0]:
                failing[0] = False
                raise RuntimeError("a collector's bug")
            return [GaugeMetricFamily("vllm_capacity_test", "a test gauge", value=1.0)]

    def snapshot(engines: int) -> Snapshot:
        return Snapshot(up=True, engines=tuple(derive_all(parse_metrics(data_parallel(engines)))))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Recorder())
    served = SimpleNamespace(snapshot=snapshot(1), http_errors={})
    renders = RenderCache(served, registry)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        await renders.body(None)
    body, _ = await renders.body(None)  # tried again, not served from the failure
    assert b"vllm_capacity_test 1.0" in body and (await renders.body(None))[0] is body
    served.snapshot = snapshot(INLINE_RENDER_ENGINES + 1)
    await renders.body(None)
    renders.close()
    main = threading.current_thread().name
    assert threads[:2] == [main, main] and len(threads) == 3 and threads[2].startswith("vllm-capacity-render")


async def test_a_render_in_the_worker_thread_shows_the_snapshot_it_began_with_whole() -> None:
    """A large snapshot renders in the worker thread while the loop goes on: the next read swaps in a new snapshot
    and the listener counts a refusal. The body is still one moment's, byte for byte the whole registry's render of
    the snapshot the render began with and the refusals counted then: not the engines of one snapshot beside the
    health of the next (a scrape once said vLLM down beside every engine's series), and never the listener's counter
    read from the thread while the loop adds to it."""
    import threading
    from collections import Counter
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from support.payloads import data_parallel
    from vllm_capacity.derive import derive_all
    from vllm_capacity.exposition.render import INLINE_RENDER_ENGINES, RenderCache, build_registry
    from vllm_capacity.snapshot import Snapshot, SourceState
    from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

    began = Snapshot(
        up=True,
        timestamp=1.0,
        engines=tuple(derive_all(parse_metrics(data_parallel(INLINE_RENDER_ENGINES + 1)))),
        sources={"vllm": SourceState(True, 0.01)},
    )
    then = Snapshot(up=False, timestamp=2.0, sources={"vllm": SourceState(False, 4.0)}, errors={("vllm", "timeout"): 1})
    served = SimpleNamespace(snapshot=began, http_errors=Counter({"bad_request": 2}))
    renders = RenderCache(served, None)  # type: ignore[arg-type]
    gate = threading.Event()
    try:
        renders._executor.submit(gate.wait)  # the worker thread is busy: the render waits behind it
        rendering = asyncio.ensure_future(renders.body(None))
        await asyncio.sleep(0.05)
        served.snapshot, served.http_errors["connection_cap"] = then, 1  # the loop goes on meanwhile
    finally:
        gate.set()
    body, _ = await rendering
    renders.close()
    moment = SimpleNamespace(snapshot=began, http_errors={"bad_request": 2})
    assert body == generate_latest(build_registry(moment, process_metrics=False))  # type: ignore[arg-type]
    assert b"vllm_capacity_up 1.0" in body and b'source_up{source="vllm"} 1.0' in body
    assert b'kind="bad_request"} 2.0' in body and b"connection_cap" not in body


async def test_every_snapshot_is_encoded_whole_and_is_what_the_registry_renders(
    h: Harness, fake_vllm: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each new snapshot is encoded whole, the engines' part too (nothing of an earlier one is kept). In every format,
    the body served is byte for byte what the whole registry renders at that moment: after an idle read, after
    vLLM's values moved, after its version changed (shown in vllm_info), and while vLLM is down (``up`` 0, no
    engine)."""
    from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS

    from vllm_capacity.exposition.render import EngineCollector, build_registry, choose_format

    encoded: list[int] = []
    add = EngineCollector.add

    def counted(self: EngineCollector, f: object, snap: object) -> None:
        encoded.append(1)
        add(self, f, snap)  # type: ignore[arg-type]

    monkeypatch.setattr(EngineCollector, "add", counted)
    whole = build_registry(h.agent, process_metrics=False)

    async def served_is_whole(expect_encoded: int) -> None:
        for accept in (None, OPENMETRICS):
            encoded.clear()
            resp = await h.http.get("/metrics", headers={"Accept": accept} if accept else {})
            body = await resp.read()
            assert len(encoded) == expect_encoded, accept
            encoder, _ = choose_format(accept)
            encoded.clear()
            rest = [line for line in encoder(whole).decode().splitlines() if "_process_" not in line]
            assert [line for line in body.decode().splitlines() if "_process_" not in line] == rest, accept

    await h.agent.cycle()  # the first read has the latency histograms; the next ones have not
    await h.agent.cycle()
    await served_is_whole(expect_encoded=1)
    await h.agent.cycle()  # idle: the same lines, encoded again
    await served_is_whole(expect_encoded=1)
    fake_vllm.metrics = with_value(fake_vllm.metrics, "vllm:num_requests_running", "3.0")
    await h.agent.cycle()
    await served_is_whole(expect_encoded=1)
    h.agent.models.version = "0.99.0"  # shown in vllm_info, beside the same engines
    h.agent.snapshot = dataclasses.replace(h.agent.snapshot, version="0.99.0")
    await served_is_whole(expect_encoded=1)
    assert 'version="0.99.0"' in await h.scrape()
    fake_vllm.status = 500
    await h.agent.cycle()
    await served_is_whole(expect_encoded=1)
    assert "vllm_capacity_up 0.0" in await h.scrape()


async def test_a_scraper_naming_ever_new_format_versions_cannot_grow_what_renders_keep(h: Harness) -> None:
    """The content type a render is kept under names the format's version, which the scraper chooses: a scraper
    asking for OpenMetrics 1.0.0, 1.0.1, 1.0.2, ... made one more body kept per request (megabytes each at a thousand
    engines). Past MAX_FORMATS formats, what was kept is forgotten; every answer is still whole."""
    from vllm_capacity.exposition.render import MAX_FORMATS, RenderCache, process_registry

    await h.agent.cycle()
    renders = RenderCache(h.agent, process_registry())
    for patch in range(3 * MAX_FORMATS):
        body, content_type = await renders.body(f"application/openmetrics-text; version=1.0.{patch}")
        assert f"version=1.0.{patch}" in content_type
        assert body.endswith(b"# EOF\n") and b"vllm_capacity_up 1.0" in body and body.count(b"# EOF") == 1
        assert 0 < len(renders._cached) <= MAX_FORMATS
    renders.close()


async def test_exporter_metrics_can_be_left_out(fake_vllm: FakeVllm) -> None:
    """--web.disable-exporter-metrics: the sidecar's own process_* series are left out, the rest is served."""
    vllm = VllmClient(fake_vllm.url, timeout=10.0)
    agent = Agent(vllm, AgentSettings(interval=0.1))
    await agent.cycle()
    for process_metrics in (True, False):
        async with TestClient(TestServer(make_app(agent, process_metrics=process_metrics))) as http:
            text = await (await http.get("/metrics")).text()
        assert ("vllm_capacity_process_resident_memory_bytes" in text) is process_metrics
        assert "vllm_capacity_up 1.0" in text
    await vllm.aclose()


async def test_vllm_is_never_asked_to_compress_its_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """prometheus-client's own exposition (vLLM's /metrics until PR #15657, March 2025, put the instrumentator's
    route in front of it: ``Mount("/metrics", make_asgi_app())``) gzips the body when the client accepts gzip, at level
    9, on vLLM's API server, every read: on a sidecar's loopback that is vLLM's CPU spent for nothing (and the
    agent's, to inflate it). Served here by the library's own server, from a registry that yields the families of a
    real 0.32 capture."""
    import gzip

    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.parser import text_string_to_metric_families

    class Capture:
        def collect(self):  # type: ignore[no-untyped-def]
            return text_string_to_metric_families(fixture_text("v1-0.32.0-cpu-saturated.prom"))

    registry = CollectorRegistry()
    registry.register(Capture())  # type: ignore[arg-type]
    compressed = []
    real_compress = gzip.compress
    monkeypatch.setattr(gzip, "compress", lambda data, *a, **k: compressed.append(len(data)) or real_compress(data))
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)  # a port of the kernel's choosing
    client = VllmClient(f"http://127.0.0.1:{server.server_port}", timeout=10)
    try:
        metrics = await client.fetch_metrics(latency=False)
    finally:
        await client.aclose()
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert metrics.engines[0].cache_config is not None
    assert metrics.engines[0].cache_config.kv_cache_size_tokens == 4096  # read in full
    assert compressed == []  # and the server compressed nothing


def test_the_same_record_again_carries_and_teaches_what_an_equal_copy_would() -> None:
    """The counters and the sustained learner depend on a read's values, never on which record holds them. Fed a
    sequence of reads (pressed, calm, preempting, restarted, each several times), the record itself and an equal
    copy of it every time give the same restarts, carried totals, preemptions and learned state."""
    import copy

    from vllm_capacity.live.counters import Counters
    from vllm_capacity.live.sustained import SustainedLearner
    from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

    preempting = with_value(SATURATED, "vllm:num_preemptions_total", "90.0")
    steps = [SATURATED, without_queue(SATURATED), without_queue(preempting), preempting, SATURATED]
    clock = FakeClock()
    runs = {alike: (Counters(clock), SustainedLearner(60.0, clock)) for alike in (True, False)}
    seen: dict[bool, list[object]] = {True: [], False: []}
    for text in steps:
        record = parse_metrics(text, latency=False)
        for _ in range(3):
            clock.advance(1.0)
            for alike, (counters, sustained) in runs.items():
                metrics = record if alike else copy.deepcopy(record)
                verdict = counters.judge(metrics)
                restarted = verdict == "restart"
                if verdict == "unconfirmed":
                    carried = counters.held()[0]
                else:
                    carried = counters.carry(metrics, restarted)
                    sustained.learn(metrics, counters.preempted)
                    counters.last = metrics
                seen[alike].append((verdict, dict(carried), counters.preempted, dict(sustained._learned)))
    assert seen[True] == seen[False]
    assert any(verdict == "restart" for verdict, *_ in seen[True])  # it holds a restart, a preemption, a level
    assert any(preempted for *_, preempted, _ in seen[True])
    assert any(learned[("tiny-llama", "0")].observed for *_, learned in seen[True])
    # what the agent's sequence cannot give, the API still holds: the same record told restarted, or preempted
    key = ("tiny-llama", "0")
    calm = parse_metrics(without_queue(SATURATED), latency=False)
    for alike, (counters, sustained) in runs.items():
        again = calm if alike else copy.deepcopy(calm)
        counters.carry(calm, False)
        seen[alike] = [counters.carry(again, True)]
        sustained.learn(calm, frozenset())
        sustained.learn(again, frozenset({key}))
        seen[alike].append(dict(sustained._learned))
    assert seen[True] == seen[False]


def test_an_idle_read_derives_what_the_whole_derivation_gives() -> None:
    """The learners change their mappings in place: every change of any part of the history (carried totals, latency
    views, preemptions, sustained levels), made in place, and of the facts, gives what ``derive_all`` gives."""
    from vllm_capacity import derive
    from vllm_capacity.live.derived import Derived
    from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

    key = ("tiny-llama", "0")
    metrics = parse_metrics(SATURATED, latency=False)
    carried: dict[tuple[str, str], float] = {key: 82.0}
    latency: dict[tuple[str, str], derive.LatencyView] = {}
    sustained: dict[tuple[str, str], derive.Sustained] = {}
    derived, facts = Derived(structlog.get_logger()), derive.ServerFacts()
    history = derive.EngineHistory(carried, latency, frozenset(), sustained)
    steps = [
        lambda: None,
        lambda: carried.update({key: 90.0}),
        lambda: latency.update({key: derive.LatencyView(slo_max_concurrency=3, context_p90_tokens=600.0)}),
        lambda: sustained.update({key: derive.Sustained(level=5.0, observed=True)}),
        lambda: sustained.update({key: derive.Sustained(level=6.0, observed=True)}),
        lambda: None,
    ]
    results = []
    for step in steps:
        step()
        for _ in range(2):
            got = derived.engines(metrics, facts, history)
            assert got == tuple(derive.derive_all(metrics, facts, history))
            results.append(got)
    history = derive.EngineHistory(carried, latency, frozenset({key}), sustained)  # preempted
    assert derived.engines(metrics, facts, history) == tuple(derive.derive_all(metrics, facts, history))
    facts = derive.ServerFacts(max_model_len={"tiny-llama": 2048})
    assert derived.engines(metrics, facts, history) == tuple(derive.derive_all(metrics, facts, history))
    metrics = parse_metrics(with_value(SATURATED, "vllm:num_requests_running", "3.0"), latency=False)
    assert derived.engines(metrics, facts, history) == tuple(derive.derive_all(metrics, facts, history))
    assert len({r[0].sustained for r in results if r[0].sustained}) == 2 and results[2][0].preemptions_total == 90.0


async def test_wrong_passwords_cannot_freeze_the_good_ones_or_the_reads(
    fake_vllm: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 clients sending wrong passwords brought reads of vLLM to zero (every bcrypt check ran in the pool the
    agent reads its log in). Now a verified credential is answered without bcrypt or a thread, wrong ones run in a
    pool of two threads of their own with a bounded queue, and past it are refused at once (429, counted)."""
    import base64
    import threading
    import time

    import bcrypt

    from vllm_capacity.web.app import CHECKS_OVER_LIMIT, Access
    from vllm_capacity.web.config import Authenticator, CredentialChecks

    def basic(password: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode()}

    real, threads, release = bcrypt.checkpw, set(), threading.Event()

    def slow_checkpw(secret: bytes, hashed: bytes) -> bool:  # a bcrypt that takes until the flood is all in
        threads.add(threading.current_thread().name)
        release.wait(10)
        return real(secret, hashed)

    access = Access(auth=Authenticator({"prometheus": bcrypt.hashpw(b"scrape-pw", bcrypt.gensalt(rounds=4))}))
    agent = Agent(VllmClient(fake_vllm.url, timeout=10.0), AgentSettings(interval=0.1))
    capacity = CredentialChecks().capacity
    async with TestClient(TestServer(make_app(agent, access=access))) as http:

        async def status(password: str) -> int:
            async with http.get("/metrics", headers=basic(password)) as resp:
                return resp.status

        await agent.cycle()
        assert await status("scrape-pw") == 200  # verified once
        monkeypatch.setattr(bcrypt, "checkpw", slow_checkpw)
        flood = [asyncio.create_task(status(f"wrong-{i}")) for i in range(60)]
        # no check ends before every wrong password is in: the checks' capacity is taken, the rest refused at once
        deadline = time.monotonic() + 20
        while agent.http_errors[CHECKS_OVER_LIMIT] < 60 - capacity and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        # the good password is answered while every check hangs: not behind them (they end only at release)
        assert await asyncio.wait_for(status("scrape-pw"), 5) == 200
        await agent.cycle()  # the agent's reads go on meanwhile
        assert agent.snapshot.up
        release.set()
        statuses = sorted([await task for task in flood])
    refused = statuses.count(429)
    assert set(statuses) == {401, 429} and refused == 60 - capacity
    assert agent.http_errors[CHECKS_OVER_LIMIT] == refused
    assert threads and all(name.startswith("vllm-capacity-bcrypt") for name in threads)
