"""The fault matrix: every way vLLM (or what stands at --vllm-url) can misbehave, in one table, each run the same
way against the agent and its HTTP endpoints.

For each row: a healthy cycle; the fault for three cycles; then vLLM healthy again. During the fault the agent must
export `vllm_capacity_up` and `source_up{source="vllm"}` true to what it could read, count the documented reason
once a cycle, log the failure once (not once a cycle), serve no series the fault made wrong and nothing non-finite
or negative, and stay live and ready (its probes never follow vLLM). Afterwards it must recover in one cycle, with
one recovery line.

Rows are numbered as in the hardening issue's table where they come from it ("held": a fault that was already
handled). What is not a fault of vLLM's answers (start-up flags, the listener, signals, manifests) has its own
tests; ELSEWHERE names them, and a test checks that each still exists.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from support.doubles import FakeClock, FakeVllm
from support.exposition import plausible, samples, value
from support.files import fixture_text
from support.payloads import with_cache_label, with_value
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.web.app import make_app

SATURATED = fixture_text("v1-0.32.0-cpu-saturated.prom")
CLOCK = FakeClock()
USAGE_LINE = next(line for line in SATURATED.splitlines() if line.startswith("vllm:kv_cache_usage_perc{"))
DERIVED = ("kv_cache_capacity_tokens", "kv_cache_used_tokens", "max_concurrency", "requests_running")


def body(text: str) -> Callable[[FakeVllm], None]:
    return lambda f: setattr(f, "metrics", text)


@dataclass(frozen=True)
class Fault:
    row: str  # the hardening issue's row, or "held"
    name: str
    setup: Callable[[FakeVllm], None]
    reason: str  # counted in source_errors_total{source="vllm"} once a faulty cycle
    read: bool = False  # vLLM could be read (the fault is in some values): up stays 1, the rest is served
    absent: tuple[str, ...] = DERIVED  # series (without the vllm_capacity_ prefix) never exported during the fault
    logged: str = ""  # the family named in the one `event` line, when read
    event: str = "implausible_values"
    client: dict[str, Any] = field(default_factory=dict)  # VllmClient arguments (a short timeout, a small cap)


KV, RUN = "vllm:kv_cache_usage_perc", "vllm:num_requests_running"


def implausible(row: str, name: str, where: str, raw: str, absent: tuple[str, ...]) -> Fault:
    """vLLM answers, but one value cannot be right: ``where`` (a family, or a cache_config_info label) set to
    ``raw``. It is named in one log line and left out with what derives from it (``absent``); the rest is served."""
    if where.startswith("vllm:"):
        text, logged = with_value(SATURATED, where, raw), where
    else:
        text, logged = with_cache_label(SATURATED, where, raw), f"vllm:cache_config_info{{{where}}}"
    return Fault(row, name, body(text), "implausible_value", read=True, absent=absent, logged=logged)


def over_limit(
    row: str,
    name: str,
    lines: str,
    family: str = RUN,
    absent: tuple[str, ...] = ("requests_running", "mean_context_tokens"),
) -> Fault:
    """vLLM answers, but ``family`` (vllm:num_requests_running unless said) passes the scan's bounds: that family is
    left out (named in one families_over_limit line), with what derives from it; the rest is served."""
    text = body(SATURATED + lines + "\n")
    return Fault(
        row, name, text, "family_over_limit", read=True, absent=absent, logged=family, event="families_over_limit"
    )


LORA = "vllm:lora_requests_info"
_LONG_ADAPTERS = f'{LORA}{{running_lora_adapters="{"a," * 4333}"}} 1.0'
_LORA_SERIES = "\n".join(
    f'{LORA}{{max_lora="4",running_lora_adapters="a{i}",waiting_lora_adapters=""}} {i}.0' for i in range(40_000)
)


FAULTS = (
    # what stands at --vllm-url is not vLLM, or not whole
    Fault("held", "HTTP 500", lambda f: setattr(f, "status", 500), "http_5xx"),
    Fault("held", "HTTP 404", lambda f: setattr(f, "status", 404), "http_4xx"),
    Fault("held", "HTTP 401", lambda f: setattr(f, "status", 401), "unauthorized"),
    Fault("held", "an HTML page", body("<html><body>oops</body></html>\n"), "not_metrics"),
    Fault("held", "an HTML content type", lambda f: setattr(f, "content_type", "text/html"), "not_metrics"),
    Fault("held", "an empty body", body(""), "empty_body"),
    # a redirect is not followed, and said as one: it was counted as an empty body (row 9)
    Fault(
        "9", "HTTP 302", lambda f: (setattr(f, "status", 302), setattr(f, "location", "http://elsewhere/m")), "redirect"
    ),
    Fault("held", "no final newline", body(SATURATED.rstrip("\n")), "truncated"),
    Fault("held", "the connection closed mid-body", lambda f: setattr(f, "truncate_to", 1000), "truncated"),
    Fault("held", "slower than --timeout", lambda f: setattr(f, "delay", 2.0), "timeout", client={"timeout": 0.5}),
    # the deadline is the whole exchange's, the body's last byte included, not the headers'
    Fault(
        "held", "a body slower than --timeout", lambda f: setattr(f, "drip", 0.1), "timeout", client={"timeout": 0.4}
    ),
    Fault(
        "9",
        "over --max-body-size",
        body(SATURATED + "#" * 70_000 + "\n"),
        "body_too_large",
        client={"max_body_bytes": 100_000},
    ),
    Fault("10", "garbage naming vllm:", body("\x00\x01 vllm: garbage {{{ \n"), "not_vllm"),
    Fault(
        "10",
        "another vllm-capacity's /metrics",
        body("# HELP vllm_capacity_up 1 if vllm:kv_cache_usage_perc was read\nvllm_capacity_up 1.0\n"),
        "not_vllm",
    ),
    Fault("10", "a duplicated series", body(SATURATED + USAGE_LINE + "\n"), "parse_error"),
    Fault(
        "held",
        "a value that is not a number",
        body(with_value(SATURATED, "vllm:num_requests_running", "x")),
        "parse_error",
    ),
    # a line past the scan's bound (the parser is quadratic in such lines): that family is left out, the rest is
    # served (round 2, row 5: it was a whole-scrape parse_error and up 0)
    over_limit("8", "a HELP line of a read family, 1 MB of spaces", "# HELP " + RUN + " " * 1_000_000 + "x"),
    over_limit("8", "a label value of 100,000 escaped quotes", RUN + '{model_name="' + '\\"' * 100_000 + '"} 1'),
    # second round, row 5: normal output of a large deployment passes a bound: that family alone is left out
    over_limit("r2-5", "40,000 LoRA series (vLLM never deletes them)", _LORA_SERIES, LORA, ("lora_slots",)),
    over_limit("r2-5", "an adapter list of 8,667 characters", _LONG_ADAPTERS, LORA, ("lora_slots",)),
    Fault(
        "held", "not UTF-8", lambda f: setattr(f, "metrics_bytes", SATURATED.encode() + b"\xff\xfe\n"), "parse_error"
    ),
    # vLLM answered, but some values cannot be right: those are left out, the rest served (row 7, row 2, row 6)
    implausible("7", "usage 1.5", KV, "1.5", ("kv_cache_usage_ratio", "kv_cache_used_tokens")),
    implausible("7", "usage -0.5", KV, "-0.5", ("kv_cache_usage_ratio", "kv_cache_free_tokens")),
    implausible("7", "usage 1e300", KV, "1e300", ("kv_cache_usage_ratio",)),
    implausible("7", "running -3", RUN, "-3", ("requests_running", "mean_context_tokens")),
    implausible("7", "running +Inf", RUN, "+Inf", ("requests_running",)),
    implausible("2", "an integer beyond a float", "vllm:num_requests_waiting", "1" + "0" * 400, ("requests_waiting",)),
    implausible(
        "6", "the preemption counter at 1.7e308", "vllm:num_preemptions_total", "1.7e308", ("preemptions_total",)
    ),
    implausible("7", "a negative block size", "block_size", "-128", ("kv_cache_block_size_tokens",)),
    # capacity falls back to blocks x block size, which are right
    implausible("7", "a negative kv_cache_size_tokens", "kv_cache_size_tokens", "-4096", ()),
)


@pytest.fixture
async def agent_http(fake_vllm: FakeVllm, request: pytest.FixtureRequest) -> AsyncIterator[tuple[Agent, TestClient]]:
    fault: Fault = request.param
    client = VllmClient(fake_vllm.url, **{"timeout": 10.0, **fault.client})
    agent = Agent(client, AgentSettings(interval=0.1), monotonic=CLOCK)
    async with TestClient(TestServer(make_app(agent))) as http:
        yield agent, http
    await client.aclose()


async def _scrape(http: TestClient) -> str:
    resp = await http.get("/metrics")
    assert resp.status == 200
    return await resp.text()


@pytest.mark.parametrize("agent_http", FAULTS, ids=[f"{f.row}: {f.name}" for f in FAULTS], indirect=True)
async def test_fault(agent_http: tuple[Agent, TestClient], fake_vllm: FakeVllm, request: pytest.FixtureRequest) -> None:
    fault: Fault = request.node.callspec.params["agent_http"]
    agent, http = agent_http
    healthy = (fake_vllm.metrics, fake_vllm.status, fake_vllm.content_type)
    fake_vllm.metrics = SATURATED
    await agent.cycle()
    assert value(await _scrape(http), "vllm_capacity_up") == 1

    fault.setup(fake_vllm)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            await agent.cycle()
    text = await _scrape(http)
    assert value(text, "vllm_capacity_up") == (1 if fault.read else 0)
    assert value(text, "vllm_capacity_source_up", source="vllm") == (1 if fault.read else 0)
    assert value(text, "vllm_capacity_source_errors_total", source="vllm", reason=fault.reason) == 3
    if fault.read:  # one line naming what was left out
        assert [list(e["families"]) for e in logs if e["event"] == fault.event] == [[fault.logged]]
    else:  # one line, with the reason and the cause
        (failed,) = [e for e in logs if e["event"] == "source_failed"]
        assert failed["reason"] == fault.reason and failed["error"]
    for name in fault.absent:
        assert f"vllm_capacity_{name}{{" not in text, name
    for (name, labels), v in samples(text).items():
        assert plausible(name, labels, v), (name, labels, v)
    assert (await http.get("/healthz")).status == 200
    assert (await http.get("/readyz")).status == 200  # readiness never follows vLLM

    CLOCK.advance(60)  # past the state log's rate limit: the recovery is logged at once
    fake_vllm.metrics, fake_vllm.status, fake_vllm.content_type = healthy
    fake_vllm.metrics, fake_vllm.delay, fake_vllm.drip, fake_vllm.location = SATURATED, 0.0, 0.0, None
    fake_vllm.truncate_to, fake_vllm.metrics_bytes = None, None
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
    text = await _scrape(http)
    assert value(text, "vllm_capacity_up") == 1
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 4096
    assert len([e for e in logs if e["event"] == "source_recovered"]) == (0 if fault.read else 1)


#: Rows of the hardening issue that are not a fault in vLLM's answers, and the tests that hold each.
ELSEWHERE = {
    "1: the sidecar's probes never depend on vLLM": ("test_deploy", "test_no_shipped_sidecar_probe_depends_on_vllm"),
    "2: an API key file with a byte-order mark or non-ASCII": (
        "test_cli",
        "test_an_api_key_that_cannot_be_sent_is_refused_at_start",
    ),
    "3: an API key file of two lines": ("test_cli", "test_an_api_key_that_cannot_be_sent_is_refused_at_start"),
    "4: userinfo in --vllm-url, the key, anywhere in output": (
        "test_agent",
        "test_no_secret_reaches_a_log_line_an_endpoint_or_an_error",
    ),
    "5: cache_config_info flapping or reformatted": (
        "test_agent",
        "test_a_flapping_or_reformatted_info_family_is_no_restart",
    ),
    "6: a counter that goes down, jumps, or overflows": (
        "test_agent",
        "test_exported_counters_never_go_down_double_count_or_become_infinite",
    ),
    "9: a body near the cap in memory": ("test_vllm_scan", "test_a_body_near_the_cap_is_read_without_a_copy"),
    "11: NaN usage on a 0.32 server": ("test_agent", "test_a_nan_usage_keeps_the_generation_of_names"),
    "12: a request line over 8 KiB, logged once and counted": (
        "test_cli",
        "test_a_client_protocol_error_is_one_json_log_line",
    ),
    "12: an odd Accept header": ("test_agent", "test_http_endpoints"),
    "13: slow and idle clients": (
        "test_listener",
        "test_at_the_cap_slow_clients_make_room_and_then_new_ones_are_refused",
    ),
    "13: a header that never ends": ("test_listener", "test_a_client_that_never_finishes_its_headers_is_closed"),
    "14: SIGTERM while a read hangs": ("test_cli", "test_sigterm_stops_at_once_while_a_read_of_vllm_hangs"),
    "15: flags checked at start": ("test_cli", "test_invalid_input_exits_2_with_one_line"),
    "16: TLS and basic auth": ("test_webconfig", "test_tls_basic_auth_and_headers"),
    "16: IPv4 and IPv6": ("test_cli", "test_the_default_listener_serves_ipv4_and_ipv6"),
    "17: --nvml auto without NVML": ("test_nvml", "test_the_real_library_without_a_gpu"),
    "18: long lists in logs": ("test_agent", "test_a_thousand_engines_make_short_log_lines"),
    "18: an error without a message": ("test_agent", "test_an_error_without_a_message_is_named_by_its_cause"),
    "18: a flapping source": ("test_agent", "test_a_flapping_source_logs_at_a_bounded_rate"),
    "19: manifests expose no more than they need": ("test_deploy", "test_manifests_expose_no_more_than_they_need"),
    "held: a crashing cycle": ("test_agent", "test_a_crashing_cycle_does_not_kill_the_loop"),
    "held: connection refused": ("test_agent", "test_connection_refused_is_counted"),
    "held: mutated real payloads": (
        "test_fuzz",
        "test_mutated_captures_give_only_documented_failures_and_plausible_numbers",
    ),
    "held: ten scrapers at 64 engines": ("test_load", "test_ten_scrapers_never_make_vllm_look_down"),
}


@pytest.mark.parametrize("row", sorted(ELSEWHERE))
def test_every_other_row_has_its_test(row: str) -> None:
    module, test = ELSEWHERE[row]
    assert callable(getattr(importlib.import_module(module), test, None)), f"{row}: {module}.{test} is gone"
