"""``promtool check metrics`` over the agent's /metrics in every mode it has, not only the one-cycle golden cases.

Each mode drives the agent through the cycles that make its series appear (the latency curve needs several reads
over time, the GPU budget NVML and vLLM's start-up log) and asserts that they did appear, so that the lint covers
them: the learned latency curve, LoRA slots, speculative decoding, the CPU tier, GPUs through the NVML stand-in,
several data-parallel engines, and vLLM gone.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from support import payloads
from support.doubles import FakeClock, FakeVllm
from support.fake_nvml import SEED_LOG, FakeNvml, seed_gpu
from support.files import FIXTURES, VLLM_FIXTURES, fixture_text
from vllm_capacity.derive.facts import ServedModel
from vllm_capacity.derive.latency_curve import parse_objective
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sources.model_config import load_config
from vllm_capacity.sources.nvml import NvmlSource
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_log import LogFollower
from vllm_capacity.web.app import make_app

SATURATED = fixture_text("v1-0.32.0-cpu-saturated.prom")
TINY = '{"data":[{"id":"tiny-llama","max_model_len":1024}]}'
ITL_LE = re.compile(
    r'^(vllm:inter_token_latency_seconds_bucket\{engine="0",le="([^"]+)",model_name="tiny-llama"\}) \S+$', re.MULTILINE
)
LORA = (
    "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n"
    'vllm:lora_requests_info{max_lora="1",running_lora_adapters="sql",waiting_lora_adapters="chat"} 1.7961258e+09\n'
)
SPEC = "".join(
    f"# HELP vllm:{name} Speculative decoding.\n# TYPE vllm:{name} counter\n"
    f'vllm:{name}{{engine="0",model_name="tiny-llama"}} {v}\n'
    for name, v in (("spec_decode_num_drafts", 40.0), ("spec_decode_num_draft_tokens", 120.0),
                    ("spec_decode_num_accepted_tokens", 70.0))
)  # fmt: skip

Drive = Callable[[Agent, FakeVllm, FakeClock], Awaitable[None]]


async def _twice(agent: Agent, fake: FakeVllm, clock: FakeClock) -> None:
    await agent.cycle()
    clock.advance(5)
    await agent.cycle()


async def _stepped_latency(agent: Agent, fake: FakeVllm, clock: FakeClock) -> None:
    """Inter-token latency 20 ms up to 4 running requests, 100 ms at 16, read every 5 s: a curve and a knee."""
    counts = {le: 0.0 for _, le in ITL_LE.findall(SATURATED)}
    for running, latency in ((1, 0.02), (4, 0.02), (16, 0.1)):
        for _ in range(3):
            for le in counts:
                counts[le] += 400.0 if float(le) >= latency else 0.0
            body = payloads.with_value(SATURATED, "vllm:num_requests_running", str(running))
            fake.metrics = ITL_LE.sub(lambda m: f"{m[1]} {counts[m[2]]}", body)
            clock.advance(5)
            await agent.cycle()


async def _then_gone(agent: Agent, fake: FakeVllm, clock: FakeClock) -> None:
    await _twice(agent, fake, clock)
    fake.status = 503
    clock.advance(5)
    await agent.cycle()


# mode: (vLLM's /metrics, /v1/models, the Agent's extra arguments given a temporary folder, how to drive it, a pattern
# of the series that must be in the output for the mode to count as linted)
MODES: dict[str, tuple[str, str, Callable[[Path], dict], Drive, str]] = {
    "latency curve and SLO": (
        SATURATED, TINY,
        lambda _: {"objectives": (parse_objective("itl", "p90<=50ms"),)},
        _stepped_latency, r'vllm_capacity_max_concurrency\{[^}]*basis="slo"',
    ),
    "LoRA slots": (SATURATED + LORA, TINY, lambda _: {}, _twice, r"vllm_capacity_lora_slots\{"),
    "speculative decoding": (SATURATED + SPEC, TINY, lambda _: {}, _twice, r"vllm_capacity_kv_cache_capacity_tokens\{"),
    "CPU tier, V1 offloading": (
        payloads.with_cache_label(SATURATED, "kv_offloading_size", "4.0"), TINY,
        lambda _: {"vllm_log": LogFollower(VLLM_FIXTURES / "v1-0.32.0-cpu-startup.log"),
                   "model": ServedModel(load_config(FIXTURES / "models" / "tiny-llama" / "config.json"))},
        _twice, r"vllm_capacity_kv_cache_cpu_capacity_tokens\{",
    ),
    "CPU tier, V0 swap": (
        fixture_text("v0-0.6.6-multiprocess.prom"),
        '{"data":[{"id":"meta-llama/Meta-Llama-3-8B","max_model_len":8192}]}',
        lambda _: {}, _twice, r"vllm_capacity_kv_cache_cpu_capacity_tokens\{",
    ),
    "GPUs through NVML": (
        fixture_text("v1-0.24-seed.prom"), '{"data":[{"id":"gemma-12b","max_model_len":32768}]}',
        lambda tmp: {"nvml": NvmlSource(loader=lambda: FakeNvml([seed_gpu()])), "vllm_pids": lambda: {4242},
                     "vllm_log": LogFollower(_written(tmp / "vllm.log", SEED_LOG))},
        _twice, r"vllm_capacity_gpu_memory_bytes\{",
    ),
    "eight data-parallel engines": (payloads.data_parallel(8), TINY, lambda _: {}, _twice,
                                    r'vllm_capacity_kv_cache_capacity_tokens\{[^}]*engine="7"'),
    "vLLM gone": (SATURATED, TINY, lambda _: {}, _then_gone, r"(?m)^vllm_capacity_up 0\.0$"),
}  # fmt: skip


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("mode", MODES)
async def test_promtool_check_metrics_in_every_mode(fake_vllm: FakeVllm, tmp_path: Path, mode: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/setup installs Debian's prometheus package"
    metrics, models, extra, drive, expected = MODES[mode]
    fake_vllm.metrics, fake_vllm.models = metrics, models
    clock = FakeClock()
    vllm = VllmClient(fake_vllm.url, timeout=10)
    given = extra(tmp_path)
    settings = {k: given.pop(k) for k in list(given) if k in AgentSettings.__dataclass_fields__}
    agent = Agent(vllm, AgentSettings(interval=5, **settings), monotonic=clock, **given)
    async with TestClient(TestServer(make_app(agent, process_metrics=True))) as http:
        await drive(agent, fake_vllm, clock)
        text = await (await http.get("/metrics")).text()
    await vllm.aclose()
    assert re.search(expected, text), f"{mode}: the mode's series did not appear, so the lint would not cover them"
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, f"{mode}:\n{result.stdout}{result.stderr}"
