"""A fleet at scale, simulated: the shipped rules and dashboards over a real Prometheus TSDB holding a week of a
1,000-pod vLLM fleet.

usage: .venv/bin/python bench/fleet.py [--pods 1000] [--clusters 3] [--models 20] [--days 7] [--raw-hours 24]
                                       [--watched 10] [--work DIR] [--write-docs]

1. **History.** Pods spread over clusters, namespaces and models (a few large models, a long tail); each model's
   demand follows a daily curve (its own phase), quieter at weekends, with per-pod noise; above the concurrency
   its KV cache allows at the observed context requests wait and are preempted. Each pod has the sidecar's series
   as the agent exports them (one engine, one GPU: capacity, usage, concurrency by basis, headroom, the limit, the
   memory budget, GPU readings) and vLLM's own that the rules and dashboards read (TTFT and inter-token latency
   histograms, generated tokens, prefix cache and speculative decoding counters), 30 s apart. Written as
   OpenMetrics, one file per 2-hour block, and turned into TSDB blocks by ``promtool tsdb create-blocks-from
   openmetrics``.
   Kept for the whole week: ``vllm_capacity_up`` and the capacity of every pod (the dashboards' variables read
   them), every series of ``--watched`` pods (the per-pod dashboard), and the recording rules' series (computed from
   the same pods, as Prometheus would have recorded them; the fleet dashboard reads only those). Every series of
   every pod for the last ``--raw-hours``: what the rules evaluate and a per-pod dashboard shows over a day.
2. **Rules.** Prometheus 2.42 started on that TSDB; each rule of alerts/ evaluated as an instant query at the end of
   the history, in file order (as Prometheus evaluates a group): the sum is one evaluation cycle per group.
3. **Dashboards.** Every query of both dashboards (panels and variables) as Grafana sends it: a range query over the
   last 24 h and 7 d, at the step Grafana picks for a 1,000-pixel panel (range / 1000, at least the 30 s scrape),
   ``$__rate_interval`` = max(step + scrape, 4 x scrape); All for cluster, namespace and model, one watched pod for
   the per-pod dashboard (and All pods, over 24 h, as the worst case). Each timed three times; the median counts.

Targets (issue 15): every dashboard query <= 1 s over 24 h at 1,000 pods; rule evaluation <= 1 s per cycle.
``--write-docs`` puts the results into docs/fleet.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRAPE = 30  # seconds between samples
BLOCK = 7200  # promtool writes 2-hour blocks: one input file per block keeps each file read once
GiB = 2**30
DOC = ROOT / "docs" / "fleet.md"


@dataclass(frozen=True)
class Model:
    name: str
    capacity_tokens: int  # KV-cache tokens per pod
    max_model_len: int
    mean_context: float  # tokens per running request, on average
    peak_utilization: float  # demand at the daily peak / the concurrency at the observed context
    phase: float  # seconds: when the model's day peaks
    weights_gib: float


@dataclass(frozen=True)
class Pod:
    index: int
    cluster: str
    namespace: str
    model: Model
    name: str
    instance: str


def fleet(pods: int, clusters: int, models: int) -> list[Pod]:
    """``pods`` pods of ``models`` models (the k-th model's share ~ 1/(k+1): a few large, a long tail), each model
    in one namespace, spread over up to ``clusters`` clusters."""
    kinds = [
        (208_625, 32_768, 0.50, 15.2),  # the seed's 7-8B model on a 24 GB GPU
        (42_656, 8_192, 0.45, 40.0),
        (520_000, 131_072, 0.35, 60.0),
        (96_000, 16_384, 0.55, 26.0),
    ]
    ms = []
    for k in range(models):
        cap, mml, ctx_share, weights = kinds[k % len(kinds)]
        ms.append(
            Model(
                name=f"model-{k:02d}",
                capacity_tokens=cap,
                max_model_len=mml,
                mean_context=mml * ctx_share / 4,
                peak_utilization=0.75 + 0.4 * ((k * 7) % 10) / 10,  # some models outgrow their pods at peak
                phase=(k * 3571) % 86_400,
                weights_gib=weights,
            )
        )
    weights = [1 / (k + 1) for k in range(models)]
    counts = [max(1, int(pods * w / sum(weights))) for w in weights]
    counts[0] += pods - sum(counts)
    out: list[Pod] = []
    for k, (m, n) in enumerate(zip(ms, counts, strict=True)):
        spread = 1 + k % clusters  # large models in one cluster or more
        for i in range(n):
            idx = len(out)
            out.append(
                Pod(
                    index=idx,
                    cluster=f"cluster-{(k + i % spread) % clusters + 1}",
                    namespace=f"team-{k % 8}",
                    model=m,
                    name=f"{m.name}-{i:04d}",
                    instance=f"10.{idx // 65536}.{idx // 256 % 256}.{idx % 256}",
                )
            )
    return out


def noise(a: float, b: float) -> float:
    """Deterministic noise in [-1, 1]."""
    return math.sin(a * 12.9898 + b * 78.233) * 0.5 + math.sin(a * 0.731 + b * 1.913) * 0.5


@dataclass
class State:
    """One pod at one moment."""

    running: float
    waiting: float
    context: float
    preempted: float  # preemptions so far (a counter)
    tokens: float  # generated tokens so far (a counter)
    ttft_count: float  # requests started so far (a counter)


def demand(m: Model, t: float) -> float:
    """The model's demand at t, as a share of its pods' concurrency at the observed context."""
    day = 0.5 + 0.5 * math.sin(2 * math.pi * (t - m.phase) / 86_400)
    weekday = time.gmtime(t).tm_wday
    weekly = 0.6 if weekday >= 5 else 1.0
    return m.peak_utilization * (0.2 + 0.8 * day) * weekly


def pod_state(p: Pod, t: float, t0: float) -> State:
    m = p.model
    context = m.mean_context * (1 + 0.15 * noise(p.index, t / 3600))
    fit = m.capacity_tokens / context
    want = max(0.0, fit * demand(m, t) * (1 + 0.1 * noise(p.index, t / SCRAPE)))
    running = min(want, fit * 0.97)
    elapsed = t - t0
    # counters from the start of the history: the integral is approximated by the mean demand (plausible slopes)
    return State(
        running=round(running),
        waiting=round(max(0.0, want - running)),
        context=context,
        preempted=max(0.0, demand(m, t) - 1.0) * 0.05 * elapsed + 0.001 * elapsed,
        tokens=running * 25 * elapsed / 2 + p.index,
        ttft_count=running * 0.05 * elapsed / 2,
    )


# (family, extra labels, value of a pod in a state): the sidecar's series, then vLLM's own, of one pod
Series = tuple[str, str, Callable[[Pod, State], float]]
LIMITS = ("kv_cache", "max_num_seqs", "slo", "none")
SOURCES = ("vllm", "models", "nvml")
COMPONENTS = ("weights", "kv_cache", "graphs_and_activations", "other_processes", "free")
TTFT_LE = ("0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "+Inf")
ITL_LE = ("0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "+Inf")


def slo_bound(p: Pod) -> float:
    """The pod's SLO-bound concurrency: 80 % of what fits at the model's mean context."""
    return 0.8 * p.model.capacity_tokens / p.model.mean_context


def _limit(limit: str) -> Callable[[Pod, State], float]:
    def value(p: Pod, s: State) -> float:
        binding = "kv_cache" if s.waiting > 0 else "none"
        return 1.0 if limit == binding else 0.0

    return value


def _share(le: str, scale: float) -> float:
    """The share of observations at or below ``le`` for latencies of typical size ``scale``."""
    return 1.0 if le == "+Inf" else 1 - math.exp(-float(le) / scale)


def _gpu_component(component: str) -> Callable[[Pod, State], float]:
    def value(p: Pod, s: State) -> float:
        kv = p.model.capacity_tokens * 21.7 * 1024 / 1.0
        parts = {
            "weights": p.model.weights_gib * GiB,
            "kv_cache": kv,
            "graphs_and_activations": 1.3 * GiB,
            "other_processes": 0.0,
        }
        parts["free"] = max(0.0, 80 * GiB - sum(parts.values()))
        return parts[component]

    return value


SIDECAR: list[Series] = [
    ("vllm_capacity_up", "", lambda p, s: 1.0),
    ("vllm_capacity_kv_cache_capacity_tokens", "", lambda p, s: p.model.capacity_tokens),
    ("vllm_capacity_kv_cache_used_tokens", "", lambda p, s: s.running * s.context),
    ("vllm_capacity_kv_cache_free_tokens", "", lambda p, s: p.model.capacity_tokens - s.running * s.context),
    ("vllm_capacity_kv_cache_usage_ratio", "", lambda p, s: s.running * s.context / p.model.capacity_tokens),
    ("vllm_capacity_kv_cache_blocks", "", lambda p, s: p.model.capacity_tokens // 16),
    ("vllm_capacity_kv_cache_block_size_tokens", "", lambda p, s: 16),
    ("vllm_capacity_kv_cache_bytes_per_token", 'method="startup_log"', lambda p, s: 22_221),
    ("vllm_capacity_kv_cache_pool_bytes", "", lambda p, s: p.model.capacity_tokens * 22_221),
    ("vllm_capacity_model_weights_bytes", "", lambda p, s: p.model.weights_gib * GiB),
    ("vllm_capacity_cuda_graph_bytes", "", lambda p, s: 0.78 * GiB),
    ("vllm_capacity_max_model_len_tokens", "", lambda p, s: p.model.max_model_len),
    ("vllm_capacity_mean_context_tokens", "", lambda p, s: s.context),
    (
        "vllm_capacity_max_concurrency",
        'basis="max_model_len"',
        lambda p, s: p.model.capacity_tokens / p.model.max_model_len,
    ),
    ("vllm_capacity_max_concurrency", 'basis="observed_context"', lambda p, s: p.model.capacity_tokens / s.context),
    ("vllm_capacity_max_concurrency", 'basis="slo"', lambda p, s: slo_bound(p)),
    (
        "vllm_capacity_concurrency_utilization_ratio",
        'basis="max_model_len"',
        lambda p, s: s.running * p.model.max_model_len / p.model.capacity_tokens,
    ),
    (
        "vllm_capacity_concurrency_utilization_ratio",
        'basis="observed_context"',
        lambda p, s: s.running * s.context / p.model.capacity_tokens,
    ),
    (
        "vllm_capacity_headroom_requests",
        'basis="observed_context"',
        lambda p, s: p.model.capacity_tokens / s.context - s.running,
    ),
    *[("vllm_capacity_concurrency_limit", f'limit="{lim}"', _limit(lim)) for lim in LIMITS],
    ("vllm_capacity_requests_running", "", lambda p, s: s.running),
    ("vllm_capacity_requests_waiting", "", lambda p, s: s.waiting),
    ("vllm_capacity_requests_waiting_for_capacity", "", lambda p, s: s.waiting),
    ("vllm_capacity_requests_waiting_deferred", "", lambda p, s: 0.0),
    ("vllm_capacity_preemptions_total", "", lambda p, s: s.preempted),
    ("vllm_capacity_engine_asleep", "", lambda p, s: 0.0),
    ("vllm_capacity_slo_knee_observed", "", lambda p, s: 1.0),
]
GPU = 'gpu="0",uuid="GPU-{index:08d}"'
SIDECAR_GPU: list[Series] = [
    ("vllm_capacity_gpu_memory_total_bytes", GPU, lambda p, s: 80 * GiB),
    ("vllm_capacity_gpu_memory_used_bytes", GPU, lambda p, s: 72 * GiB),
    ("vllm_capacity_gpu_memory_free_bytes", GPU, lambda p, s: 8 * GiB),
    ("vllm_capacity_gpu_memory_budget_bytes", GPU, lambda p, s: 72 * GiB),
    *[(("vllm_capacity_gpu_memory_bytes", GPU + f',component="{c}"', _gpu_component(c))) for c in COMPONENTS],
    ("vllm_capacity_gpu_utilization_ratio", GPU, lambda p, s: min(1.0, 0.2 + s.running / 40)),
    ("vllm_capacity_gpu_memory_bandwidth_utilization_ratio", GPU, lambda p, s: min(1.0, 0.1 + s.running / 60)),
    ("vllm_capacity_gpu_power_watts", GPU, lambda p, s: 120 + 4 * s.running),
    ("vllm_capacity_gpu_power_limit_watts", GPU, lambda p, s: 700),
    ("vllm_capacity_gpu_temperature_celsius", GPU, lambda p, s: 40 + s.running / 4),
    ("vllm_capacity_gpu_sm_clock_hertz", GPU, lambda p, s: 1.98e9),
    ("vllm_capacity_gpu_throttled", GPU + ',reason="sw_power_cap"', lambda p, s: 0.0),
    *[("vllm_capacity_source_up", f'source="{src}"', lambda p, s: 1.0) for src in SOURCES],
    *[("vllm_capacity_source_duration_seconds", f'source="{src}"', lambda p, s: 0.004) for src in SOURCES],
    ("vllm_capacity_source_errors_total", 'source="vllm",reason="timeout"', lambda p, s: 2.0),
]


def _ttft_bucket(le: str) -> Callable[[Pod, State], float]:
    return lambda p, s: s.ttft_count * _share(le, 0.3 + s.waiting / 20)


def _itl_bucket(le: str) -> Callable[[Pod, State], float]:
    return lambda p, s: s.tokens * _share(le, 0.012 + s.running / 4000)


VLLM: list[Series] = [
    *[("vllm:time_to_first_token_seconds_bucket", f'le="{le}"', _ttft_bucket(le)) for le in TTFT_LE],
    ("vllm:time_to_first_token_seconds_count", "", lambda p, s: s.ttft_count),
    *[("vllm:inter_token_latency_seconds_bucket", f'le="{le}"', _itl_bucket(le)) for le in ITL_LE],
    ("vllm:generation_tokens_total", "", lambda p, s: s.tokens),
    ("vllm:prefix_cache_queries_total", "", lambda p, s: s.tokens * 3),
    ("vllm:prefix_cache_hits_total", "", lambda p, s: s.tokens * 1.1),
    # speculative decoding, 3 draft tokens a step, 2 of them accepted on average
    ("vllm:spec_decode_num_draft_tokens_total", "", lambda p, s: s.tokens * 0.6),
    ("vllm:spec_decode_num_accepted_tokens_total", "", lambda p, s: s.tokens * 0.4),
    ("vllm:spec_decode_num_drafts_total", "", lambda p, s: s.tokens * 0.2),
]
PER_POD = len(SIDECAR) + len(SIDECAR_GPU) + len(VLLM)
# what the dashboards' variables read, kept for every pod over the whole history
LONG = {"vllm_capacity_up", "vllm_capacity_kv_cache_capacity_tokens"}


def _labels(p: Pod, job: str, extra: str) -> str:
    port = "9790" if job == "vllm-capacity" else "8000"
    base = (
        f'cluster="{p.cluster}",namespace="{p.namespace}",pod="{p.name}",instance="{p.instance}:{port}",'
        f'job="{job}",model_name="{p.model.name}",engine="0"'
    )
    return base + ("," + extra.format(index=p.index) if extra else "")


def _fmt(v: float) -> str:
    return repr(float(v)) if v != int(v) else str(int(v))


def records(pods: list[Pod], states: list[list[State]]) -> dict[tuple[str, str], list[float]]:
    """The recording rules' series over one window, computed from the pods (as alerts/vllm-capacity-rules.yaml
    would record them): {(record, labels): values per step}."""
    out: dict[tuple[str, str], list[float]] = {}
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i, p in enumerate(pods):
        groups.setdefault((p.cluster, p.namespace, p.model.name), []).append(i)
    steps = len(states[0])
    for (cluster, ns, model), members in groups.items():
        lab = f'cluster="{cluster}",namespace="{ns}",model_name="{model}"'
        cap = sum(pods[i].model.capacity_tokens for i in members)

        def per_step(f: Callable[[Pod, State], float], members: list[int] = members) -> list[float]:
            return [sum(f(pods[i], states[i][k]) for i in members) for k in range(steps)]

        used = per_step(lambda p, s: s.running * s.context)
        running = per_step(lambda p, s: s.running)
        waiting = per_step(lambda p, s: s.waiting)
        observed = per_step(lambda p, s: p.model.capacity_tokens / s.context)
        mml = cap / pods[members[0]].model.max_model_len
        slo = sum(slo_bound(pods[i]) for i in members)
        # the replica's binding bound: per pod the smaller of observed_context and slo, averaged over the pods
        per_replica = [
            v / len(members) for v in per_step(lambda p, s: min(p.model.capacity_tokens / s.context, slo_bound(p)))
        ]
        n = "namespace_model_name:vllm_capacity_"
        out[(n + "kv_cache_capacity_tokens:sum", lab)] = [cap] * steps
        out[(n + "kv_cache_used_tokens:sum", lab)] = used
        out[(n + "kv_cache_free_tokens:sum", lab)] = [cap - u for u in used]
        out[(n + "kv_cache_usage:ratio", lab)] = [u / cap for u in used]
        out[(n + "requests_running:sum", lab)] = running
        out[(n + "requests_waiting:sum", lab)] = waiting
        out[(n + "replicas:count", lab)] = [len(members)] * steps
        out[(n + "replica_capacity_requests:avg", lab)] = per_replica
        out[(n + "replicas_needed:ceil", lab)] = [
            math.ceil((r + w) / (c * 0.8)) for r, w, c in zip(running, waiting, per_replica, strict=True)
        ]
        out[(n + "prefix_cache_hit:ratio", lab)] = [1.1 / 3] * steps
        out[(n + "spec_decode_acceptance:ratio", lab)] = [0.4 / 0.6] * steps
        for basis, values in (("max_model_len", [mml] * steps), ("observed_context", observed), ("slo", [slo] * steps)):
            out[("namespace_model_name_basis:vllm_capacity_max_concurrency:sum", lab + f',basis="{basis}"')] = values
            out[
                ("namespace_model_name_basis:vllm_capacity_concurrency_utilization:ratio", lab + f',basis="{basis}"')
            ] = [r / v for r, v in zip(running, values, strict=True)]
    by_ns: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(pods):
        by_ns.setdefault((p.cluster, p.namespace), []).append(i)
    for (cluster, ns), members in by_ns.items():
        for c in COMPONENTS:
            f = _gpu_component(c)
            total = sum(f(pods[i], states[i][0]) for i in members)
            lab = f'cluster="{cluster}",namespace="{ns}",component="{c}"'
            out[("namespace_component:vllm_capacity_gpu_memory_bytes:sum", lab)] = [total] * steps
    return out


def write_window(path: Path, pods: list[Pod], start: int, t0: int, full: bool, watched: set[int]) -> int:
    """One 2-hour window as OpenMetrics (families grouped, each series' samples in time order); the samples."""
    times = list(range(start, start + BLOCK, SCRAPE))
    states = [[pod_state(p, t, t0) for t in times] for p in pods]
    written = 0
    with path.open("w") as out:
        families: dict[str, list[tuple[str, list[float]]]] = {}
        for series, job in ((SIDECAR, "vllm-capacity"), (SIDECAR_GPU, "vllm-capacity"), (VLLM, "vllm")):
            for name, extra, value in series:
                for p in pods:
                    if not (full or p.index in watched or name in LONG):
                        continue
                    st = states[p.index]
                    families.setdefault(name, []).append((_labels(p, job, extra), [value(p, s) for s in st]))
        for (name, labels), values in records(pods, states).items():
            families.setdefault(name, []).append((labels, values))
        for name, members in families.items():
            out.write(f"# TYPE {name} unknown\n")
            for labels, values in members:
                head = f"{name}{{{labels}}} "
                out.write("".join(f"{head}{_fmt(v)} {t}\n" for v, t in zip(values, times, strict=True)))
                written += len(values)
        out.write("# EOF\n")
    return written


def build(args: argparse.Namespace, work: Path) -> tuple[list[Pod], int, dict[str, float]]:
    """The TSDB under work/data; the pods, the end of the history and the build's figures."""
    pods = fleet(args.pods, args.clusters, args.models)
    end = int(time.time()) // BLOCK * BLOCK
    start = end - int(args.days * 86_400) // BLOCK * BLOCK
    raw_from = end - int(args.raw_hours * 3600)
    watched = set(range(0, len(pods), max(1, len(pods) // args.watched)))
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    samples, gen_s, import_s = 0, 0.0, 0.0
    for window in range(start, end, BLOCK):
        t = time.monotonic()
        path = work / "window.om"
        samples += write_window(path, pods, window, start, window >= raw_from, watched)
        gen_s += time.monotonic() - t
        t = time.monotonic()
        subprocess.run(
            [_tool("promtool"), "tsdb", "create-blocks-from", "openmetrics", "-q", str(path), str(data)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        import_s += time.monotonic() - t
        path.unlink()
        print(f"  {time.strftime('%Y-%m-%d %H:%M', time.gmtime(window))} UTC: {samples:,} samples", file=sys.stderr)
    size = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    return pods, end, {"samples": samples, "generate_s": gen_s, "import_s": import_s, "tsdb_bytes": size}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        sys.exit(f"{name} missing: scripts/setup installs Debian's prometheus package")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus(work: Path) -> Iterator[str]:
    port = _free_port()
    (work / "prometheus.yml").write_text("global: {scrape_interval: 30s}\n")
    with (work / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                "--storage.tsdb.retention.time=60d",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                        break
                time.sleep(0.5)
            else:
                raise SystemExit(f"Prometheus not ready: {(work / 'prometheus.log').read_text()[-2000:]}")
            yield url
        finally:
            proc.terminate()
            proc.wait(30)


def timed(client: httpx.Client, path: str, params: dict[str, str]) -> tuple[float, int]:
    """The median of three runs (seconds) and the number of series answered."""
    runs, count = [], 0
    for _ in range(3):
        t = time.perf_counter()
        r = client.get(path, params=params)
        runs.append(time.perf_counter() - t)
        r.raise_for_status()
        body = r.json()
        if body["status"] != "success":
            raise SystemExit(f"{params}: {body}")
        data = body["data"]
        count = len(data["result"]) if isinstance(data, dict) else len(data)
    return statistics.median(runs), count


def rule_cycles(client: httpx.Client, at: int) -> list[tuple[str, float, int]]:
    """Per rule group: the time of one evaluation (its rules in order, as instant queries at ``at``)."""
    out = []
    for name in ("vllm-capacity-alerts.yaml", "vllm-capacity-rules.yaml"):
        for group in yaml.safe_load((ROOT / "alerts" / name).read_text())["groups"]:
            total, rules = 0.0, 0
            for rule in group["rules"]:
                seconds, _ = timed(client, "/api/v1/query", {"query": rule["expr"], "time": str(at)})
                total += seconds
                rules += 1
            out.append((group["name"], total, rules))
    return out


def records_agree(client: httpx.Client, at: int) -> tuple[int, list[str]]:
    """The recording rules' series the history holds against the rules' own expressions evaluated on the raw series
    at ``at``: the series compared, and the disagreements (relative difference over 1e-6)."""
    compared, wrong = 0, []
    for group in yaml.safe_load((ROOT / "alerts" / "vllm-capacity-rules.yaml").read_text())["groups"]:
        for rule in group["rules"]:

            def answer(query: str) -> dict[str, float]:
                r = client.get("/api/v1/query", params={"query": query, "time": str(at)})
                r.raise_for_status()
                return {
                    json.dumps({k: v for k, v in x["metric"].items() if k != "__name__"}, sort_keys=True): float(
                        x["value"][1]
                    )
                    for x in r.json()["data"]["result"]
                }

            stored, evaluated = answer(rule["record"]), answer(rule["expr"])
            if set(stored) != set(evaluated):
                wrong.append(f"{rule['record']}: series differ")
                continue
            for key, v in stored.items():
                compared += 1
                if abs(v - evaluated[key]) > 1e-6 * max(1.0, abs(v)):
                    wrong.append(f"{rule['record']} {key}: history {v}, rule {evaluated[key]}")
    return compared, wrong


def grafana(expr: str, step: int, pod: str) -> str:
    rate = max(step + SCRAPE, 4 * SCRAPE)
    expr = expr.replace("$__rate_interval", f"{rate}s").replace("$__interval", f"{step}s")
    expr = expr.replace('"$pod"', f'"{pod}"')
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def dashboard_queries(client: httpx.Client, end: int, pod: str, all_pods: bool) -> list[dict]:
    rows = []
    for name in ("vllm-capacity.json", "vllm-capacity-fleet.json"):
        d = json.loads((ROOT / "dashboards" / name).read_text())
        targets = [(p["title"], t["expr"]) for p in d["panels"] if p["type"] != "row" for t in p["targets"]]
        variables = [
            (f"variable {v['name']}", v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
            for v in d["templating"]["list"]
            if v["type"] == "query"
        ]
        for title, expr in targets + variables:
            row = {"dashboard": name, "title": title, "expr": expr}
            ranges = [("24h", 86_400), ("7d", 7 * 86_400)] if not all_pods else [("24h", 86_400)]
            for label, seconds in ranges:
                step = max(SCRAPE, math.ceil(seconds / 1000 / SCRAPE) * SCRAPE)
                q = grafana(expr, step, ".*" if all_pods else pod)
                m = re.fullmatch(r"label_values\((.+), *(\w+)\)", q)
                if m:  # what Grafana asks for a variable: the label's values over the range
                    params = {"match[]": m[1], "start": str(end - seconds), "end": str(end)}
                    row[label], row[label + "_series"] = timed(client, f"/api/v1/label/{m[2]}/values", params)
                else:
                    params = {"query": q, "start": str(end - seconds), "end": str(end), "step": str(step)}
                    row[label], row[label + "_series"] = timed(client, "/api/v1/query_range", params)
            rows.append(row)
    return rows


def report(
    args: argparse.Namespace, pods: list[Pod], figures: dict, cycles: list, rows: list, worst: list
) -> list[str]:
    clusters = len({p.cluster for p in pods})
    models = len({p.model.name for p in pods})
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Prometheus {_version()}; {time.strftime('%Y-%m-%d', time.gmtime())}.",
        "",
        f"History: {len(pods):,} pods of {PER_POD} series, {clusters} clusters, {models} models, {args.days:g} days "
        f"at {SCRAPE} s (all of it, for every pod: {len(pods) * PER_POD * args.days * 86_400 / SCRAPE:,.0f} samples); "
        "every "
        f"series of every pod for the last {args.raw_hours:g} h, of {args.watched} watched pods and of the recording "
        "rules for the whole history: "
        f"{figures['samples']:,} samples, TSDB {figures['tsdb_bytes'] / GiB:.2f} GiB "
        f"(generated in {figures['generate_s']:.0f} s, imported by promtool in {figures['import_s']:.0f} s). "
        f"The recorded series equal the rules' own expressions on the raw series at the end of the history "
        f"({figures['records_compared']:,} series compared).",
        "",
        "| rule group | rules | one evaluation (s) | target |",
        "|---|---|---|---|",
    ]
    for name, seconds, n in cycles:
        lines.append(f"| `{name}` | {n} | {seconds:.3f} | {'ok' if seconds <= 1 else 'OVER'} (<= 1 s) |")
    lines += [
        "",
        "| dashboard | panel or variable | 24 h (s) | 7 d (s) | series |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        title = r["title"].replace("|", "/")
        lines.append(
            f"| {r['dashboard'].removesuffix('.json')} | {title} | {r['24h']:.3f} | {r['7d']:.3f} | {r['24h_series']} |"
        )
    slowest = max(rows, key=lambda r: r["24h"])
    lines += [
        "",
        f"Slowest query over 24 h: {slowest['24h']:.3f} s ({slowest['dashboard']}: {slowest['title']}); "
        f"target <= 1 s: {'met' if slowest['24h'] <= 1 else 'MISSED'}.",
    ]
    if worst:
        w = max(worst, key=lambda r: r["24h"])
        lines.append(
            f"The per-pod dashboard with All pods selected (all {len(pods):,} at once, beyond its purpose): slowest "
            f"query {w['24h']:.3f} s over 24 h ({w['title']})."
        )
    return lines


def _version() -> str:
    out = subprocess.run([_tool("prometheus"), "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).split()[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--models", type=int, default=20)
    ap.add_argument("--days", type=float, default=7)
    ap.add_argument("--raw-hours", type=float, default=24)
    ap.add_argument("--watched", type=int, default=10, help="pods whose every series is kept for the whole history")
    ap.add_argument("--work", type=Path, help="where the TSDB goes (default: a temporary folder, removed)")
    ap.add_argument("--write-docs", action="store_true", help="put the results into docs/fleet.md")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-")))
        work.mkdir(parents=True, exist_ok=True)
        print("building the history:", file=sys.stderr)
        pods, end, figures = build(args, work)
        watched_pod = pods[0].name
        with prometheus(work) as url, httpx.Client(base_url=url, timeout=120) as client:
            answer = client.get("/api/v1/query", params={"query": "count(vllm_capacity_up)", "time": str(end - SCRAPE)})
            assert int(float(answer.json()["data"]["result"][0]["value"][1])) == len(pods), answer.text
            compared, wrong = records_agree(client, end - SCRAPE)
            if wrong:
                raise SystemExit(
                    "the simulated recording-rule series disagree with the rules:\n" + "\n".join(wrong[:20])
                )
            figures["records_compared"] = compared
            cycles = rule_cycles(client, end - SCRAPE)
            rows = dashboard_queries(client, end - SCRAPE, watched_pod, all_pods=False)
            worst = [
                r
                for r in dashboard_queries(client, end - SCRAPE, watched_pod, all_pods=True)
                if r["dashboard"] == "vllm-capacity.json"
            ]
    lines = report(args, pods, figures, cycles, rows, worst)
    print("\n".join(lines))
    if args.write_docs:
        write_docs(lines)


def write_docs(lines: list[str]) -> None:
    text = DOC.read_text()
    begin, finish = "<!-- fleet:begin -->", "<!-- fleet:end -->"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(finish)
    DOC.write_text(head + begin + "\n" + "\n".join(lines) + "\n" + finish + tail)


if __name__ == "__main__":
    main()
