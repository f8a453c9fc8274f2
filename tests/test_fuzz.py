"""A bounded fuzz test: mutations of real vLLM captures, one after another through the agent, as a sidecar would
meet them. Nothing but a documented failure may come of it: no exception escapes a cycle, every failure has a
documented reason, and nothing exported is non-finite, negative, or a counter that went down.

VLLM_CAPACITY_FUZZ_CASES sets how many bodies (1,500 by default, a few seconds; the benchmark's fuzz mode runs more).
"""

from __future__ import annotations

import os
import random
import re

from prometheus_client import generate_latest

from support.doubles import FakeVllm
from support.exposition import plausible, samples
from support.files import fixture_text
from vllm_capacity.exposition.render import build_registry
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sources import Reason
from vllm_capacity.sources.vllm import VllmClient

CASES = int(os.environ.get("VLLM_CAPACITY_FUZZ_CASES", "1500"))
SEEDS = ("v1-0.32.0-cpu-saturated.prom", "v1-0.24-seed.prom", "v1-0.10.2-dp2.prom", "v0-0.6.6-multiprocess.prom")
ODD_VALUES = ("NaN", "+Inf", "-Inf", "-1", "-0", "1e300", "1.7e308", "1" + "0" * 400, "0.5", "2", "1e-300", "abc")
SAMPLE = re.compile(r"^(?P<series>[a-zA-Z_:][^ ]*) (?P<value>\S+)$")


def _mutate(text: str, rng: random.Random) -> str:
    lines = text.splitlines() or [""]
    i = rng.randrange(len(lines))
    kind = rng.randrange(7)
    sample_lines = [n for n, line in enumerate(lines) if SAMPLE.match(line)]
    if kind == 0 and sample_lines:  # a sample's value replaced by an odd one
        i = rng.choice(sample_lines)
        m = SAMPLE.match(lines[i])
        assert m
        lines[i] = f"{m['series']} {rng.choice(ODD_VALUES)}"
    elif kind == 1:  # a line dropped
        del lines[i]
    elif kind == 2:  # a line repeated
        lines.insert(i, lines[i])
    elif kind == 3:  # a byte replaced
        line = lines[i]
        if line:
            j = rng.randrange(len(line))
            lines[i] = line[:j] + rng.choice('{}",=\\ x0-.:#\t') + line[j + 1 :]
    elif kind == 4:  # a label value changed
        lines[i] = re.sub(r'="[^"]*"', f'="{rng.choice(["-5", "None", "", "1e400", "x", "0"])}"', lines[i], count=1)
    elif kind == 5:  # cut short
        return "\n".join(lines)[: rng.randrange(1, max(2, len(text)))]
    else:  # an engine's series moved to another engine
        lines[i] = lines[i].replace('engine="0"', 'engine="1"')
    return "\n".join(lines) + "\n"


async def test_mutated_captures_give_only_documented_failures_and_plausible_numbers(fake_vllm: FakeVllm) -> None:
    rng = random.Random(20261201)
    bodies = [fixture_text(name) for name in SEEDS]
    agent = Agent(VllmClient(fake_vllm.url, timeout=10), AgentSettings(interval=0.1))
    registry = build_registry(agent, process_metrics=False)
    documented = {r.value for r in Reason}
    counters: dict[tuple, float] = {}
    failed = 0
    for n in range(CASES):
        body = rng.choice(bodies)
        for _ in range(rng.randrange(1, 4)):
            body = _mutate(body, rng)
        fake_vllm.metrics = body
        await agent.cycle()  # must not raise, whatever the body
        failed += not agent.snapshot.up
        assert {reason for _, reason in agent.errors} <= documented
        text = generate_latest(registry).decode()
        now: dict[tuple, float] = {}
        for (name, labels), value in samples(text).items():
            assert plausible(name, labels, value), (n, name, labels, value, body[:300])
            if name == "vllm_capacity_preemptions_total":
                # while a series stays, it never goes down; one that went away (its engine gone) starts afresh
                assert labels not in counters or value >= counters[labels], (n, labels, value, counters[labels])
                now[labels] = value
        if agent.snapshot.up:
            counters = now
    await agent.client.aclose()
    # the mutations do reach both sides: some bodies refused, most served
    assert 0 < failed < CASES
