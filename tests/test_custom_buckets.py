"""Histograms with the bucket edges an operator chose (vLLM 0.32's --custom-histogram-buckets, e.g.
'{"inter_token_latency": [0.015, 0.03, 0.045, 0.07, 0.2, 1.5], ...}': vllm/v1/metrics/loggers.py ``histogram_buckets``
with ``overrides``): every histogram the agent reads works from the edges it is served, never vLLM's defaults. The
payloads are vLLM 0.32's real capture with those families' buckets rewritten as a server started with such a flag
serves them (the edges as prometheus-client writes ``le``, +Inf last, the counts cumulative)."""

from __future__ import annotations

import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from support.doubles import FakeClock, FakeVllm
from support.exposition import samples, value
from support.files import fixture_text
from support.payloads import with_value, without_queue
from vllm_capacity.derive.facts import ServerFlags
from vllm_capacity.derive.latency_curve import parse_objective
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_metrics.parse import parse_metrics
from vllm_capacity.web.app import make_app

SATURATED = fixture_text("v1-0.32.0-cpu-saturated.prom")
ITL = "vllm:inter_token_latency_seconds"
STEPS = "vllm:iteration_tokens_total"
PROMPT = "vllm:request_prompt_tokens"
CUSTOM_ITL = (0.015, 0.03, 0.045, 0.07, 0.2, 1.5)  # none but 0.03 among vLLM's default edges
CUSTOM_STEPS = (3.0, 100.0, 5000.0)
CUSTOM_PROMPT = (300.0, 750.0, 3000.0)


def _le(edge: float) -> str:
    return repr(float(edge))  # prometheus-client's floatToGoString for these


def with_buckets(text: str, family: str, counts: dict[float, float], total_sum: float | None = None) -> str:
    """``text`` with ``family``'s bucket lines replaced by ``counts`` (edge -> cumulative count; +Inf from the
    largest), and its _count (and _sum, when given) to match."""
    bucket = re.compile(rf'^{re.escape(family)}_bucket\{{engine="0",le="[^"]+",model_name="tiny-llama"\}} \S+\n', re.M)
    first = bucket.search(text)
    assert first, family
    lines = [f'{family}_bucket{{engine="0",le="{_le(e)}",model_name="tiny-llama"}} {c}\n' for e, c in counts.items()]
    total = max(counts.values(), default=0.0)
    lines.append(f'{family}_bucket{{engine="0",le="+Inf",model_name="tiny-llama"}} {total}\n')
    text = text[: first.start()] + "".join(lines) + bucket.sub("", text[first.start() :])
    text = with_value(text, f"{family}_count", str(total))
    return with_value(text, f"{family}_sum", str(total_sum)) if total_sum is not None else text


def test_the_parser_reads_the_edges_it_is_served() -> None:
    body = with_buckets(SATURATED, ITL, {e: 10.0 * i for i, e in enumerate(CUSTOM_ITL, 1)})
    body = with_buckets(body, PROMPT, {300.0: 1.0, 750.0: 30.0, 3000.0: 40.0})
    (engine,) = parse_metrics(body).engines
    assert tuple(le for le, _ in engine.latency["itl"][:-1]) == CUSTOM_ITL
    assert tuple(le for le, _ in engine.latency["prompt"][:-1]) == CUSTOM_PROMPT


async def test_the_latency_curve_and_its_knee_from_custom_edges(fake_vllm: FakeVllm) -> None:
    """The agent's test of the default edges (test_agent.py) on edges of the operator's: 20 ms up to 4 running, 40 ms
    at 8, 100 ms at 16; --slo-itl p90<=50ms allows 8, the knee seen at 16."""
    counts = dict.fromkeys(CUSTOM_ITL, 0.0)
    clock = FakeClock()
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=5, objectives=(parse_objective("itl", "p90<=50ms"),)), monotonic=clock)

    def body(running: int) -> str:
        return with_buckets(
            with_value(without_queue(SATURATED), "vllm:num_requests_running", str(running)), ITL, counts
        )

    async with TestClient(TestServer(make_app(agent))) as http:
        fake_vllm.metrics = body(1)
        await agent.cycle()
        for running, latency in ((1, 0.02), (2, 0.02), (4, 0.02), (8, 0.04), (16, 0.1)):
            for _ in range(3):
                for le in counts:
                    counts[le] += 200.0 if le >= latency else 0.0
                fake_vllm.metrics = body(running)
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
    # inside the custom buckets: (0.015, 0.03] at 1-4, (0.03, 0.045] at 8, (0.07, 0.2] at 16
    assert all(0.015 < p90[c] <= 0.03 for c in (1, 2, 4))
    assert 0.03 < p90[8] <= 0.045 and 0.07 < p90[16] <= 0.2
    assert value(text, "vllm_capacity_max_concurrency", basis="slo") == 8
    assert value(text, "vllm_capacity_slo_knee_observed") == 1


@pytest.mark.parametrize("edges", [CUSTOM_STEPS, (1.0, 8.0, 16.0, 32.0, 64.0, 128.0)])
async def test_the_token_budget_fill_from_any_step_edges(fake_vllm: FakeVllm, edges: tuple[float, ...]) -> None:
    """Full steps (a budget of 64, every step 64 tokens) name the token budget whatever the step histogram's edges:
    the fill is the steps' mean (sum over count), which no edge enters."""
    clock = FakeClock()
    vllm = VllmClient(fake_vllm.url, timeout=10)
    agent = Agent(vllm, AgentSettings(interval=5, flags=ServerFlags(max_num_batched_tokens=64)), monotonic=clock)
    steps = 0.0

    def body() -> str:
        text = with_value(SATURATED, "vllm:num_preemptions_total", "0")
        text = with_value(text, "vllm:kv_cache_usage_perc", "0.01")
        counts = {e: (steps if e >= 64 else 0.0) for e in edges}
        return with_buckets(text, STEPS, counts, total_sum=steps * 64)

    fake_vllm.metrics = body()
    await agent.cycle()
    for _ in range(3):
        steps += 100
        fake_vllm.metrics = body()
        clock.advance(5)
        await agent.cycle()
    (e,) = agent.snapshot.engines
    assert e.token_budget_fill_ratio == pytest.approx(1.0)
    assert e.concurrency_limit == "token_budget"
    await vllm.aclose()
