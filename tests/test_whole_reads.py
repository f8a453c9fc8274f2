"""Never a stale value served as current: the agent keeps memory across reads only where it is state (the learners,
the counters carried over restarts, what it read of /v1/models and how its sources fared), and computes everything
else whole on every read. Over long random sequences of recorded and generated payloads (restarts, engines coming
and going, cache configs that change, queues and preemptions, vLLM down, idle stretches), the exposition after each
read is byte for byte what a freshly started agent, given that state as it stood before the read, computes for the
same read."""

from __future__ import annotations

import copy
import random
import re

import pytest
from prometheus_client import generate_latest

from support.doubles import FakeClock, FakeVllm
from support.files import fixture_text
from support.payloads import data_parallel, with_cache_label, with_value, without_queue
from support.vllm034 import metrics_034
from vllm_capacity.derive.facts import ServerFlags
from vllm_capacity.exposition.render import build_registry
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sources.vllm import VllmClient

RECORDED = [
    "v1-0.32.0-cpu-saturated.prom",
    "v1-0.32.0-cpu-idle.prom",
    "v1-0.32.0-cpu-after.prom",
    "v1-0.24-seed.prom",
    "v1-0.10.2-dp2.prom",
    "v1-0.8.5-legacy.prom",
    "v0-0.6.6-multiprocess.prom",
]


def _payloads(rng: random.Random) -> list[str]:
    """One random read's body, or "" for vLLM down: a recording, or the saturated capture moved."""
    saturated = fixture_text("v1-0.32.0-cpu-saturated.prom")
    kind = rng.choice(["recorded", "moved", "moved", "engines", "config", "034", "restart", "down"])
    if kind == "recorded":
        return [fixture_text(rng.choice(RECORDED))]
    if kind == "engines":
        return [data_parallel(rng.randint(1, 4))]
    if kind == "config":
        text = with_cache_label(saturated, "num_gpu_blocks", str(rng.choice([16, 24, 64])))  # 32 in the capture
        return [with_cache_label(text, "block_size", str(rng.choice([16, 32, 64])))]  # 128 in the capture
    if kind == "034":
        return [metrics_034(rejections=(rng.randint(0, 3), rng.randint(0, 3)))]
    if kind == "down":
        return [""]
    text = saturated if rng.random() < 0.5 else without_queue(saturated)
    text = with_value(text, "vllm:num_requests_running", f"{rng.randint(0, 20)}.0")
    text = with_value(text, "vllm:num_preemptions_total", f"{rng.choice([82, 90, 120, 3])}.0")  # 3: a restart
    if kind == "restart":
        text = re.sub(r"^process_start_time_seconds \S+$", f"process_start_time_seconds {rng.randint(1, 9)}e9", text,
                      flags=re.MULTILINE)  # fmt: skip
    return [text] * rng.choice([1, 1, 2, 5])  # an idle stretch: the same body read after read


STATE = ("counters", "latency", "sustained")  # the learners and the restart counters


def _fresh(url: str, settings: AgentSettings, state: dict, wall, clock: FakeClock) -> Agent:
    """A freshly started agent given ``state``: the learners and counters, what was read of /v1/models and /version
    (and when it is due again), the sources' book (states, failures counted, backoffs), readiness, and the last
    snapshot (what a failed read keeps of it: its timestamp)."""
    agent = Agent(VllmClient(url, timeout=10), settings, clock=wall, monotonic=clock)
    for name in STATE:
        setattr(agent, name, state[name])
    agent.sources, agent.models = state["sources"], state["models"]
    agent.errors = agent.sources.errors
    agent.models.client, agent.models.sources = agent.client, agent.sources
    agent.ready, agent.snapshot = state["ready"], state["snapshot"]
    return agent


def _exposition(agent: Agent) -> str:
    return generate_latest(build_registry(agent, process_metrics=False)).decode()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_every_read_is_what_a_fresh_agent_with_the_same_state_computes(fake_vllm: FakeVllm, seed: int) -> None:
    rng = random.Random(seed)
    clock = FakeClock()
    wall = lambda: 1.8e9 + clock.now  # noqa: E731
    settings = AgentSettings(interval=1.0, flags=ServerFlags(max_model_len=2048))
    agent = Agent(VllmClient(fake_vllm.url, timeout=10), settings, clock=wall, monotonic=clock)
    reads = 0
    seen = set()
    while reads < 120:
        for body in _payloads(rng):
            fake_vllm.metrics, fake_vllm.status = (body, 200) if body else ("down", 503)
            clock.advance(rng.choice([0.1, 1.0, 1.0, 5.0, 60.0]))
            state = {name: copy.deepcopy(getattr(agent, name)) for name in (*STATE, "sources")}
            state.update(models=copy.copy(agent.models), ready=agent.ready, snapshot=agent.snapshot)
            await agent.cycle()
            got = _exposition(agent)
            fresh = _fresh(fake_vllm.url, settings, state, wall, clock)
            await fresh.cycle()
            assert got == _exposition(fresh), f"read {reads} (seed {seed}) differs from a fresh agent's"
            await fresh.client.aclose()
            seen.add((agent.snapshot.up, len(agent.snapshot.engines), agent.snapshot.schema))
            reads += 1
    assert len(seen) >= 6  # up and down, one engine and several, more than one schema
    await agent.client.aclose()
