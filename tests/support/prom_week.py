"""A week of two deployments in a real Prometheus, with truths planted for ``advise`` to find: written as OpenMetrics,
turned into TSDB blocks by ``promtool tsdb create-blocks-from openmetrics`` (as bench/fleet.py builds its fleet), and
served by Debian's ``prometheus``.

- ``serving/llama-8b`` (two pods, vLLM 0.32, 16-bit KV, max_model_len 32,768, --gpu-memory-utilization 0.9): p99.9
  of request lengths about 6,100 tokens (prompt 5,455 + output 667 by vLLM's own 1-2-5 buckets); demand that peaks
  every day at 19:00 UTC, above what the KV cache holds for about four hours, when requests wait and are preempted
  (only then); a latency knee at ``KNEE`` running requests, observed; 2.5 GiB of the GPU free at least.
- ``batch/qwen-7b`` (one pod, vLLM 0.34, max_model_len 8,192): a few requests at a time, never near a limit.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from vllm_capacity import sizing
from vllm_capacity.geometry import Geometry

GiB = 2**30
STEP = 240  # seconds between samples
DAYS = 7
PEAK_HOUR = 19
KNEE = 20  # running requests above which the latency objective broke
HOLDS = 28  # running requests per pod the KV cache holds at the observed context
LLAMA_POOL = 26 * GiB
LLAMA_WEIGHTS = int(14.96 * GiB)
# vLLM's build_1_2_5_buckets(max_model_len) with the share of requests at or below each bound
PROMPT_CDF = {1: 0, 2: 0, 5: 0, 10: 0.001, 20: 0.005, 50: 0.02, 100: 0.06, 200: 0.15, 500: 0.4, 1000: 0.7,
              2000: 0.9, 5000: 0.9989, 10000: 1.0, 20000: 1.0}  # fmt: skip
OUTPUT_CDF = {1: 0, 2: 0, 5: 0, 10: 0.01, 20: 0.05, 50: 0.2, 100: 0.45, 200: 0.8, 500: 0.9985, 1000: 1.0,
              2000: 1.0, 5000: 1.0, 10000: 1.0, 20000: 1.0}  # fmt: skip
CALM_CDF = {1: 0, 2: 0, 5: 0, 10: 0.01, 20: 0.05, 50: 0.1, 100: 0.2, 200: 0.4, 500: 0.7, 1000: 0.9, 2000: 0.99,
            5000: 1.0}  # fmt: skip


@dataclass(frozen=True)
class Deployment:
    namespace: str
    model: str
    pods: int
    capacity_tokens: int
    max_model_len: int
    version: str
    gpu_memory_utilization: str
    demand: Callable[[float], float]  # requests per pod at time t (running + waiting)
    requests_per_second: float
    prompt_cdf: dict[int, float]
    output_cdf: dict[int, float]
    knee: int | None = None


def _peak_demand(t: float) -> float:
    """Per pod: 6 at night, 32 at 19:00 UTC every day."""
    hours = (t % 86400) / 3600 - PEAK_HOUR
    return 6 + 26 * math.cos(math.pi * hours / 24) ** 16


def deployments(llama: Geometry) -> list[Deployment]:
    tokens = sizing.plan(
        llama, sizing.PlanInputs(kv_cache_memory_bytes=LLAMA_POOL, max_model_len=32768, version=(0, 32, 0))
    ).kv_cache_tokens
    return [
        Deployment("serving", "llama-8b", 2, tokens, 32768, "0.32.0", "0.9", _peak_demand, 1.0, PROMPT_CDF,
                   OUTPUT_CDF, knee=KNEE),
        Deployment("batch", "qwen-7b", 1, 100_000, 8192, "0.34.0", "None", lambda t: 3 + math.sin(t / 5000),
                   0.2, CALM_CDF, CALM_CDF),
    ]  # fmt: skip


def _series(d: Deployment, pod: str, start: int, t: int, state: dict[str, float]) -> list[tuple[str, str, float]]:
    """(name, extra labels, value) of one pod at ``t``; ``state`` carries its counters."""
    demand = d.demand(t)
    running = min(demand, HOLDS)
    waiting = demand - running
    over = demand > HOLDS
    if over:
        state["preempted"] += (demand - HOLDS) * 0.5
    elapsed = t - start
    requests = d.requests_per_second * elapsed
    out = [
        ("vllm_capacity_up", "", 1.0),
        ("vllm_capacity_kv_cache_capacity_tokens", 'engine="0"', d.capacity_tokens),
        ("vllm_capacity_max_model_len_tokens", 'engine="0"', d.max_model_len),
        ("vllm_capacity_kv_cache_usage_ratio", 'engine="0"', min(0.99, running / HOLDS)),
        ("vllm_capacity_requests_running", 'engine="0"', running),
        ("vllm_capacity_requests_waiting", 'engine="0"', waiting),
        ("vllm_capacity_requests_waiting_for_capacity", 'engine="0"', waiting),
        ("vllm_capacity_kv_cache_used_tokens", 'engine="0"', min(0.99, running / HOLDS) * d.capacity_tokens),
        ("vllm_capacity_preemptions_total", 'engine="0"', state["preempted"]),
        ("vllm_capacity_concurrency_limit", 'engine="0",limit="kv_cache"', 1.0 if over else 0.0),
        ("vllm_capacity_concurrency_limit", 'engine="0",limit="max_num_seqs"', 0.0),
        ("vllm_capacity_concurrency_limit", 'engine="0",limit="token_budget"', 0.0),
        ("vllm_capacity_max_concurrency", 'engine="0",basis="p90_context"', d.capacity_tokens / 3000),
        ("vllm_capacity_vllm_info", f'engine="0",version="{d.version}",cache_dtype="auto",block_size="16",'
         f'gpu_memory_utilization="{d.gpu_memory_utilization}",schema="v1"', 1.0),
        ("vllm:request_prompt_tokens_count", 'engine="0"', requests),
    ]  # fmt: skip
    if d.knee is not None:
        out += [
            ("vllm_capacity_max_concurrency", 'engine="0",basis="slo"', float(d.knee)),
            ("vllm_capacity_slo_knee_observed", 'engine="0"', 1.0),
            ("vllm_capacity_kv_cache_pool_bytes", 'engine="0"', LLAMA_POOL),
            ("vllm_capacity_model_weights_bytes", 'engine="0"', LLAMA_WEIGHTS),
            ("vllm_capacity_gpu_memory_total_bytes", 'gpu="0",uuid="GPU-' + pod + '"', 80.0 * GiB),
            ("vllm_capacity_gpu_memory_bytes", 'gpu="0",uuid="GPU-' + pod + '",component="free"', 2.5 * GiB),
        ]
    for name, cdf in (("vllm:request_prompt_tokens_bucket", d.prompt_cdf),
                      ("vllm:request_generation_tokens_bucket", d.output_cdf)):  # fmt: skip
        for le, share in cdf.items():
            out.append((name, f'engine="0",le="{le}.0"', round(requests * share)))
        out.append((name, 'engine="0",le="+Inf"', round(requests)))
    return out


def write_week(path: Path, llama: Geometry, end: int) -> None:
    """The week before ``end`` as one OpenMetrics file (families grouped, each series in time order)."""
    start = end - DAYS * 86400
    families: dict[str, dict[str, list[str]]] = {}
    for d in deployments(llama):
        for i in range(d.pods):
            pod = f"{d.model}-{i}"
            base = f'cluster="c1",namespace="{d.namespace}",pod="{pod}",model_name="{d.model}"'
            state = {"preempted": 0.0}
            for t in range(start, end + 1, STEP):
                for name, extra, value in _series(d, pod, start, t, state):
                    # the GPU series carry no model_name, as the sidecar exports them
                    gpu = name.startswith("vllm_capacity_gpu")
                    labels = base.replace(f',model_name="{d.model}"', "") if gpu else base
                    key = f"{name}{{{labels}{',' + extra if extra else ''}}}"
                    families.setdefault(name, {}).setdefault(key, []).append(f"{key} {value} {t}\n")
    with path.open("w") as out:
        for name, members in families.items():
            out.write(f"# TYPE {name} unknown\n")
            for lines in members.values():
                out.writelines(lines)
        out.write("# EOF\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def prometheus_with_week(
    work: Path, llama: Geometry, web_config: Path | None = None, auth: tuple[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """A Prometheus serving the week (behind ``web_config``'s TLS and basic auth when given, ``auth`` its user and
    password); its URL and the week's end (Unix seconds, an hour before now, on the hour), once it is ready."""
    end = int(time.time()) // 3600 * 3600 - 3600
    om, data = work / "week.om", work / "data"
    write_week(om, llama, end)
    promtool = shutil.which("promtool")
    binary = shutil.which("prometheus")
    assert promtool and binary, "promtool and prometheus: scripts/setup installs Debian's prometheus"
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(om), str(data)], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    om.unlink()
    (work / "prometheus.yml").write_text("global: {scrape_interval: 1m}\n")
    proc, url = _start(binary, work, data, web_config, auth)
    try:
        yield url, end
    finally:
        proc.terminate()
        proc.wait(30)


def _start(
    binary: str, work: Path, data: Path, web_config: Path | None, auth: tuple[str, str] | None
) -> tuple[subprocess.Popen[bytes], str]:
    """This Prometheus, serving on a free port, once it says it listens there and is ready. A port found free can be
    taken before Prometheus binds it (another test worker's Prometheus): then this one exits, and another port is
    tried; the readiness probe alone would have been answered by the other server."""
    for _ in range(5):
        port, log_path = _free_port(), work / "prometheus.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={data}",
                 "--storage.tsdb.retention.time=60d", f"--web.listen-address=127.0.0.1:{port}",
                 *([f"--web.config.file={web_config}"] if web_config else [])],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        url = f"{'https' if web_config else 'http'}://127.0.0.1:{port}"
        listening = f'msg="Listening on" address=127.0.0.1:{port}'
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if listening in log_path.read_text():
                with contextlib.suppress(httpx.HTTPError):
                    # its TSDB loaded (TLS not verified: the server is known to be this one by its log)
                    if httpx.get(url + "/-/ready", timeout=2, verify=False, auth=auth).status_code == 200:  # noqa: S501
                        return proc, url
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
            raise AssertionError(f"Prometheus not ready: {log_path.read_text()[-2000:]}")
        proc.wait()
    raise AssertionError(f"Prometheus did not start on a free port: {(work / 'prometheus.log').read_text()[-2000:]}")
