"""Golden end-to-end output in the style of node_exporter's e2e-output.txt.

The agent scrapes a loopback server that serves each vLLM fixture (every metric generation), and its own /metrics,
fetched over HTTP, must equal ``tests/fixtures/e2e-output.txt`` byte for byte, less the series that cannot be
deterministic (durations, the Python version in build_info). ``pytest --update-golden`` rewrites the file; the diff
then shows in review what changed. Each output is also linted by ``promtool check metrics``.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from aiohttp.test_utils import TestClient, TestServer

from support.doubles import FakeVllm
from support.files import FIXTURES, VLLM_FIXTURES, fixture_text
from vllm_capacity.derive.facts import ServedModel
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sources.model_config import load_config
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_log import LogFollower
from vllm_capacity.web.app import make_app

GOLDEN = FIXTURES / "e2e-output.txt"
SKIP = re.compile(r"^(# (HELP|TYPE) )?vllm_capacity_(source_duration_seconds|build_info|process_)")


def _models(name: str, max_model_len: int) -> str:
    return f'{{"object":"list","data":[{{"id":"{name}","object":"model","max_model_len":{max_model_len}}}]}}'


CASES = [
    ("v1-0.32.0-cpu-idle.prom", _models("tiny-llama", 1024)),
    # with the server's startup log and the model's config.json: bytes per token by every method, the KV pool
    ("v1-0.32.0-cpu-saturated.prom+log", _models("tiny-llama", 1024)),
    ("v1-0.32.0-cpu-saturated.prom", _models("tiny-llama", 1024)),
    ("v1-0.24-seed.prom", _models("gemma-12b", 32768)),
    ("v1-0.10.2-dp2.prom", _models("qwen3-14b", 32768)),
    ("v1-0.8.5-legacy.prom", _models("Qwen/Qwen2.5-7B-Instruct", 32768)),
    ("v0-0.6.6-multiprocess.prom", _models("meta-llama/Meta-Llama-3-8B", 8192)),
]


async def _agent_output(fake: FakeVllm, fixture: str, models: str, *, process_metrics: bool) -> str:
    name, _, with_log = fixture.partition("+")
    fake.metrics, fake.models = fixture_text(name), models
    vllm = VllmClient(fake.url, timeout=2)
    settings = AgentSettings(interval=1)
    log = None
    if with_log:
        settings = AgentSettings(
            interval=1, model=ServedModel(load_config(FIXTURES / "models" / "tiny-llama" / "config.json"))
        )
        log = LogFollower(VLLM_FIXTURES / "v1-0.32.0-cpu-startup.log")
    agent = Agent(vllm, settings, vllm_log=log, clock=lambda: 1_800_000_000.0)
    async with TestClient(TestServer(make_app(agent, process_metrics=process_metrics))) as http:
        await agent.cycle()
        await agent.cycle()  # a second cycle: counters carried, nothing doubled
        text = await (await http.get("/metrics")).text()
    await vllm.aclose()
    return text


async def test_golden_output(fake_vllm: FakeVllm, request: pytest.FixtureRequest) -> None:
    parts = []
    for fixture, models in CASES:
        text = await _agent_output(fake_vllm, fixture, models, process_metrics=False)
        kept = [line for line in text.splitlines() if not SKIP.match(line)]
        parts.append(f"## fixture: {fixture}\n" + "\n".join(kept) + "\n")
    got = "".join(parts)
    if request.config.getoption("--update-golden"):
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "agent output changed: review, then run pytest --update-golden"


@pytest.mark.parametrize(("fixture", "models"), CASES)
async def test_promtool_check_metrics(fake_vllm: FakeVllm, fixture: str, models: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/setup installs Debian's prometheus package"
    text = await _agent_output(fake_vllm, fixture, models, process_metrics=True)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
