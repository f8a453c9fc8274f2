"""End to end, all real, on loopback: vLLM (CPU) -> vllm-capacity -> Prometheus (the shipped rules, only their
`for` shortened) -> Alertmanager (the shipped example, its receivers pointed at a local webhook) -> webhook. A second
Prometheus scrapes the same two targets as another cluster would (other job names, a `k8s_cluster` label) with the
monitoring mixin rendered for that (OTHER_CONFIG in tests/support/promql.py): its pages and its dashboards' queries
are held to the same checks.

Load saturates a 200-block KV cache: VLLMKVCacheSaturated reaches the pager receiver with the model's name and real
numbers, and resolves when the load stops; killing vLLM pages VLLMTargetDown. Every dashboard query returns data
from this Prometheus at least once, except those listed in NO_DATA_HERE with the reason.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

import lab
from support.promql import OTHER_CONFIG, render_mixin
from test_dashboards import exprs, promql_for_promtool

pytestmark = pytest.mark.realvllm
ROOT = Path(__file__).resolve().parents[1]
FOR = "2s"  # the only change made to the shipped rules
CAPACITY_TOKENS = lab.SATURATION_BLOCKS * 128  # the cache under load (lab.SATURATION_KV_ARGS)
# Dashboard queries that cannot return data on this machine, and why.
NO_DATA_HERE = {
    "vllm_capacity_gpu_": "no GPU here: NVML has no library, so no GPU series exist",
    "namespace_component:vllm_capacity_gpu_memory_bytes:sum": "no GPU here",
    "vllm:spec_decode_": "the test server runs no speculative decoding: vLLM exports no spec_decode_* counters",
    "vllm_capacity_kv_cache_blocks_per_request": "the e2e agents run without --model-config (test_real_vllm_hybrid "
    "checks the layout against real servers)",
    "vllm_capacity_kv_cache_plan_mismatch": "the e2e agents run without --model-config: no plan to hold vLLM to",
    "vllm_capacity_cuda_graph_bytes": "vLLM's CPU build captures no CUDA graphs: its log has no 'Graph capturing' line",
    "vllm_capacity_activation_peak_bytes": "vLLM's CPU build profiles no GPU memory: its log has no activation peak",
    "vllm_capacity_lora_": "the test server runs without --enable-lora (test_real_vllm_lora serves two adapters on "
    "one slot)",
}


class Webhook:
    """Alertmanager's webhook receiver: records (path, seconds since start, payload)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, float, dict]] = []
        self.t0 = time.monotonic()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.received.append((self.path, time.monotonic(), body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, name: str, status: str, cluster: str | None = None) -> list[tuple[str, float, dict]]:
        """The alerts received by name and status, from the Prometheus of ``cluster`` (None: the shipped rules')."""
        return [
            (path, t, a)
            for path, t, body in self.received
            for a in body["alerts"]
            if a["labels"]["alertname"] == name
            and a["status"] == status
            and a["labels"].get(OTHER_CONFIG["clusterLabel"]) == cluster
        ]

    def wait(self, name: str, status: str, timeout: float, cluster: str | None = None) -> tuple[str, float, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.alerts(name, status, cluster)
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(
            f"no {status} {name} within {timeout}s; received: "
            f"{[(p, a['labels']['alertname'], a['status']) for p, _, b in self.received for a in b['alerts']]}"
        )


def _wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready in {timeout}s")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("stack")
    procs: list[subprocess.Popen] = []
    logs: list = []

    def start(log_name: str, argv: list) -> None:
        logs.append((work / log_name).open("w"))
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=logs[-1]))

    lab.install()
    vllm = lab.VllmServer(log_path=work / "vllm.log", extra_args=lab.SATURATION_KV_ARGS).start()
    hook = Webhook()
    try:
        # Alertmanager: the shipped example, receivers pointed here, group timings shortened
        am = yaml.safe_load((ROOT / "alerts" / "alertmanager.yaml").read_text())
        for r in am["receivers"]:
            r["webhook_configs"][0]["url"] = f"{hook.url}/{r['name']}"
        am["route"].update(group_wait="1s", group_interval="1s")
        (work / "alertmanager.yaml").write_text(yaml.safe_dump(am))
        am_port, prom_port, agent_port = lab.free_port(), lab.free_port(), lab.free_port()
        start(
            "alertmanager.log",
            [
                shutil.which("prometheus-alertmanager"),
                f"--config.file={work / 'alertmanager.yaml'}",
                f"--storage.path={work / 'am'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
            ],
        )
        # Prometheus: the shipped rules with only `for` shortened
        alerts = yaml.safe_load((ROOT / "alerts" / "vllm-capacity-alerts.yaml").read_text())
        for rule in alerts["groups"][0]["rules"]:
            rule["for"] = FOR
        (work / "alerts.yaml").write_text(yaml.safe_dump(alerts))
        shutil.copy(ROOT / "alerts" / "vllm-capacity-rules.yaml", work / "rules.yaml")
        # the other cluster's Prometheus: the mixin rendered with OTHER_CONFIG, `for` shortened the same way
        other = render_mixin(OTHER_CONFIG)
        for rule in other["alerts"]["groups"][0]["rules"]:
            rule["for"] = FOR
        (work / "other-alerts.yaml").write_text(yaml.safe_dump(other["alerts"]))
        (work / "other-rules.yaml").write_text(yaml.safe_dump(other["rules"]))
        vllm.wait_ready()
        start(
            "agent.log",
            lab.agent_command(
                vllm.url,
                agent_port,
                "500ms",
                "--timeout",
                "10s",
                "--vllm-log",
                str(vllm.log_path),
                "--model-dir",
                str(vllm.cache / "tiny-llama"),
                "--slo-itl",  # a generous objective: the SLO-bound concurrency (a lower bound) gets a value
                "p90<=1s",
            ),
        )
        labels = {"namespace": "e2e", "pod": "vllm-0"}
        prom = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yaml", "rules.yaml"],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [
                {
                    "job_name": "vllm-capacity",
                    "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"], "labels": labels}],
                },
                {"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{vllm.port}"], "labels": labels}]},
            ],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(prom))
        other_labels = {**labels, OTHER_CONFIG["clusterLabel"]: "east"}
        other_prom = {
            **prom,
            "rule_files": ["other-alerts.yaml", "other-rules.yaml"],
            "scrape_configs": [
                {
                    "job_name": "gpu-sidecar",
                    "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"], "labels": other_labels}],
                },
                {
                    "job_name": "vllm-engine",
                    "static_configs": [{"targets": [f"127.0.0.1:{vllm.port}"], "labels": other_labels}],
                },
            ],
        }
        (work / "other-prometheus.yml").write_text(yaml.safe_dump(other_prom))
        other_port = lab.free_port()
        for name, config, port in (
            ("prometheus", "prometheus.yml", prom_port),
            ("other", "other-prometheus.yml", other_port),
        ):
            start(
                f"{name}.log",
                [
                    shutil.which("prometheus"),
                    f"--config.file={work / config}",
                    f"--storage.tsdb.path={work / name}-tsdb",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--rules.alert.resend-delay=1s",
                ],
            )
        _wait_http(f"http://127.0.0.1:{am_port}/-/ready")
        _wait_http(f"http://127.0.0.1:{prom_port}/-/ready")
        _wait_http(f"http://127.0.0.1:{other_port}/-/ready")
        _wait_http(f"http://127.0.0.1:{agent_port}/readyz")
        for proc, log in zip(procs, logs, strict=True):  # each ready check reached its own process, which still runs
            assert proc.poll() is None, (
                f"{log.name} exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}"
            )
        yield {
            "vllm": vllm,
            "hook": hook,
            "prom": f"http://127.0.0.1:{prom_port}",
            "other_prom": f"http://127.0.0.1:{other_port}",
            "other": other,
            "agent": f"http://127.0.0.1:{agent_port}",
            "work": work,
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:  # each reaped, whatever happens
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        vllm.stop()
        hook.server.shutdown()
        hook.server.server_close()
        for f in logs:
            f.close()


def _wait_for_data(prom: str, query: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            r = client.get(prom + "/api/v1/query", params={"query": query})
            if r.status_code == 200 and r.json()["data"]["result"]:
                return
            time.sleep(0.5)
    raise AssertionError(f"Prometheus has no data for {query} after {timeout}s")


def dashboard_queries(dashboards: dict[str, dict] | None = None, cluster: str | None = None) -> list[str]:
    """The queries of the shipped dashboards (or of ``dashboards``), variables substituted as Grafana's All does
    (the cluster variable set to ``cluster`` when given: then only series that carry it answer)."""
    if dashboards is None:
        dashboards = {
            name: json.loads((ROOT / "dashboards" / name).read_text())
            for name in ("vllm-capacity.json", "vllm-capacity-fleet.json")
        }
    picked = (lambda e: e.replace('"$cluster"', f'"{cluster}"')) if cluster else (lambda e: e)
    return sorted({promql_for_promtool(picked(e)) for d in dashboards.values() for e in exprs(d)})


def queries_with_data(prom: str, start: float, end: float, queries: list[str]) -> set[str]:
    """The dashboard queries that returned data at least once over [start, end], asked as Grafana asks: as range
    queries (some series exist only while requests run, for seconds at a time)."""
    found = set()
    with httpx.Client(timeout=60) as client:
        for q in queries:
            r = client.get(
                prom + "/api/v1/query_range",
                params={"query": q.replace("5m]", "1m]"), "start": start, "end": end, "step": "1"},
            )
            r.raise_for_status()
            if any(series["values"] for series in r.json()["data"]["result"]):
                found.add(q)
    return found


@dataclass(frozen=True)
class Read:
    """What the agent said of the engine at one of its reads."""

    usage: float | None
    running: float | None
    waiting: float | None  # waiting for capacity
    headroom: float | None
    basis: str | None
    sustained: float | None
    observed: float | None
    kv_cache_limit: bool

    @classmethod
    def of(cls, text: str) -> Read | None:
        def number(pattern: str) -> float | None:
            found = re.search(rf"^vllm_capacity_{pattern} (\S+)$", text, re.M)
            return float(found[1]) if found else None

        if number("up") != 1.0:
            return None
        room = re.search(r'^vllm_capacity_headroom_requests\{[^}]*basis="(\w+)"[^}]*\} (\S+)$', text, re.M)
        kv_limit = r'^vllm_capacity_concurrency_limit\{[^}]*limit="kv_cache"[^}]*\} 1\.0$'
        return cls(
            usage=number(r"kv_cache_usage_ratio\{[^}]*\}"),
            running=number(r"requests_running\{[^}]*\}"),
            waiting=number(r"requests_waiting_for_capacity\{[^}]*\}"),
            headroom=float(room[2]) if room else None,
            basis=room[1] if room else None,
            sustained=number(r'max_concurrency\{[^}]*basis="sustained"[^}]*\}'),
            observed=number(r"sustained_queue_observed\{[^}]*\}"),
            kv_cache_limit=re.search(kv_limit, text, re.M) is not None,
        )


def _level_band(levels: list[float]) -> tuple[float, float]:
    """Where a figure learned from these running levels (the agent's is their mean, decayed over an hour) may
    fairly lie, given that the test saw only some of the agent's reads: their 10th to 90th percentile, and never
    narrower than 25 % either side of their median. On a quiet machine vLLM holds one level (the band is the 25 %);
    beside a busy loop it ran 1 to 64 requests at reads a second apart, and a sample of 20 of them put the mean of
    what the test saw 12 requests from the agent's own."""
    median = statistics.median(levels)
    if len(levels) < 2:  # no spread to speak of
        return 0.75 * median, 1.25 * median
    tenths = statistics.quantiles(levels, n=10, method="inclusive")
    return min(tenths[0], 0.75 * median), max(tenths[-1], 1.25 * median)


def _saturation_truth(prom: str, reads: list[Read], started: float) -> None:
    """#27's moment, live: at every read while requests waited for capacity the agent gave no headroom; it named the
    KV cache; what it learned vLLM sustains is a level vLLM held at the reads it counts as pressed (requests waiting
    for capacity, or a preemption since the read before: its headroom's basis says which); the fleet rule, in the
    real Prometheus, asked for a second replica while saturated and for 1 within two evaluations (30 s each, as
    shipped) of the load's end, when the headroom came back above 0."""
    queued = [r for r in reads if (r.waiting or 0) > 0]
    assert queued, "the load never made requests wait for capacity"
    assert all(r.headroom is not None and r.headroom <= 0 for r in queued), [r for r in queued if not r.headroom]
    assert any(r.kv_cache_limit for r in queued), "concurrency_limit never named kv_cache while requests waited"
    levels = sorted(r.running for r in reads if r.basis in ("queue", "preemption") and r.running is not None)
    learned = next(r.sustained for r in reversed(reads) if r.observed == 1.0 and r.sustained is not None)
    low, high = _level_band(levels)
    print(f"pressed ({len(levels)} reads): vLLM ran {levels}; the agent learned it sustains {learned:.1f}")
    assert low <= learned <= high, (learned, low, high)
    # the shipped rule's expression, evaluated by the real Prometheus at every second since the test began (the
    # recorded series is sampled every 30 s, and a saturated stretch here can be shorter than that)
    rules = {r["record"]: r["expr"] for r in yaml.safe_load((ROOT / "alerts" / "vllm-capacity-rules.yaml").read_text())
             ["groups"][0]["rules"]}  # fmt: skip
    capacity = "namespace_model_name:vllm_capacity_replica_capacity_requests:avg"
    needed_expr = rules["namespace_model_name:vllm_capacity_replicas_needed:ceil"].replace(
        capacity, f"({rules[capacity]})"
    )
    with httpx.Client(timeout=30) as client:
        series = client.get(
            prom + "/api/v1/query_range",
            params={"query": needed_expr, "start": started, "end": time.time(), "step": "1"},
        ).json()["data"]["result"]
        peak = max((float(v) for s in series for _, v in s["values"]), default=None)
        assert peak is not None and peak >= 2, series

        # the load has stopped; vLLM finishes (or drops) what it holds: once the agent reads it calm, the headroom
        # is above 0, and the fleet rule asks for 1 replica within two of its evaluations (30 s each, as shipped)
        # (calm: nothing runs or waits, and no preemption since the agent's last read: the drain's last read can
        # still count the preemptions of its final moments, and then says at most 0, rightly)
        def calm(r: Read) -> bool:
            return r.running == 0 and r.waiting == 0 and r.basis not in ("queue", "preemption")

        drained_by = time.monotonic() + 180
        while time.monotonic() < drained_by and not (reads and calm(reads[-1])):
            time.sleep(0.5)
        assert reads and calm(reads[-1]), reads[-3:]
        assert reads[-1].headroom is not None and reads[-1].headroom > 0, reads[-1]
        calm_by = time.monotonic() + 2 * 30 + 15  # two evaluations of the fleet group, and a scrape's lag
        needed = None
        while time.monotonic() < calm_by:
            result = client.get(
                prom + "/api/v1/query", params={"query": "namespace_model_name:vllm_capacity_replicas_needed:ceil"}
            ).json()["data"]["result"]
            needed = float(result[0]["value"][1]) if result else None
            if needed == 1:
                break
            time.sleep(1)
    print(f"replicas needed: {peak:g} at the peak, {needed} once vLLM was calm")
    assert needed == 1, needed


def test_pages_on_kv_pressure_resolves_and_pages_when_vllm_dies(stack, record_figure) -> None:
    vllm, hook, prom = stack["vllm"], stack["hook"], stack["prom"]
    started = time.time()

    # the agent's view, to know when saturation began, and every read it served: what it said while requests waited
    onset: dict[str, float] = {}
    reads: list[Read] = []
    stop_watch = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop_watch.is_set():
                try:
                    text = client.get(stack["agent"] + "/metrics").text
                except httpx.HTTPError:
                    stop_watch.wait(0.25)  # the agent gone (a failed test's teardown): poll, do not spin
                    continue
                read = Read.of(text)
                if read is not None:
                    if (read.usage or 0) > 0.95 and (read.waiting or 0) > 0:
                        onset.setdefault("saturated", time.monotonic())
                    if not reads or read != reads[-1]:  # a new snapshot (the agent reads vLLM every second)
                        reads.append(read)
                stop_watch.wait(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # bursts of 96 long requests, round after round, from a process as low in priority as vLLM itself: 64 run,
    # ~28 fit at their full 900 tokens, the rest wait for capacity or are preempted
    load_started = time.monotonic()
    load = subprocess.Popen(
        [
            *("nice", "-n", "10", sys.executable, str(ROOT / "scripts" / "vllm-cpu" / "load.py"), vllm.url),
            *lab.SATURATION_LOAD_ARGS,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        path, paged_at, alert = hook.wait("VLLMKVCacheSaturated", "firing", timeout=480)
        # the other cluster's Prometheus evaluates the same samples with the mixin's rules: it pages too. Its own
        # `for` starts at its own evaluation: beside a CPU hog one saturated stretch paged the first cluster and ended
        # before the second's `for` ran out; the load goes on, round after round, until the next stretch
        other_path, _, other_alert = hook.wait("VLLMKVCacheSaturated", "firing", timeout=240, cluster="east")
    finally:
        out, _ = lab.stop_process(load, timeout=300)
    rounds = [json.loads(line) for line in out.splitlines()]
    completed, errors = sum(r["requests"] for r in rounds), sum(r["errors"] for r in rounds)
    print(f"\nload: {len(rounds)} rounds of {lab.SATURATION_PARALLEL} requests: {completed} completed, {errors} errors")
    took = paged_at - onset.get("saturated", paged_at)
    print(
        f"\nVLLMKVCacheSaturated paged {took:.1f} s after the agent first saw the cache saturated "
        f"(for: {FOR}, scrape and evaluation every 1 s)"
    )
    record_figure(
        f"VLLMKVCacheSaturated paged {paged_at - load_started:.0f} s after the load began (the wait allows 480 s), "
        f"{took:.0f} s after the agent first saw the cache saturated; {len(rounds)} load rounds"
    )
    assert path == "/pager"  # critical is routed to the pager by the shipped Alertmanager configuration
    assert alert["labels"]["model_name"] == lab.MODEL_NAME and alert["labels"]["severity"] == "critical"
    description = alert["annotations"]["description"]
    print("description:", description)
    m = re.search(r"hold ([\d.]+)% of the KV cache \((\d+) tokens\)", description)
    assert m, description
    assert float(m[1]) > 95 and int(m[2]) == CAPACITY_TOKENS, description
    # the mixin's alert, by its own job, cluster label and runbook: the same numbers (its query finds the capacity
    # through the cluster label), its runbook where OTHER_CONFIG points
    assert other_path == "/pager" and other_alert["labels"]["job"] == "gpu-sidecar", other_alert
    other_m = re.search(r"hold ([\d.]+)% of the KV cache \((\d+) tokens\)", other_alert["annotations"]["description"])
    assert other_m and int(other_m[2]) == CAPACITY_TOKENS, other_alert["annotations"]
    assert other_alert["annotations"]["runbook_url"].startswith(OTHER_CONFIG["runbookURL"] + "#")

    _, resolved_at, _ = hook.wait("VLLMKVCacheSaturated", "resolved", timeout=120)
    hook.wait("VLLMKVCacheSaturated", "resolved", timeout=60, cluster="east")
    print(f"VLLMKVCacheSaturated resolved {resolved_at - paged_at:.1f} s after it paged, once the load stopped")
    _saturation_truth(prom, reads, started)
    stop_watch.set()
    watcher.join(timeout=10)

    # the fleet recording rules are evaluated every 30 s (their group's interval, as shipped): wait for one evaluation
    # while vLLM is up, or a quick page-and-resolve can leave the fleet dashboard's queries without any data
    _wait_for_data(prom, "namespace_model_name:vllm_capacity_replicas:count", timeout=60)
    _wait_for_data(stack["other_prom"], 'namespace_model_name:vllm_capacity_replicas:count{k8s_cluster="east"}', 60)
    # and one evaluation after the load: the prefix-cache hit ratio is a ratio of rates, NaN (no data to a dashboard)
    # until the queries counter has moved in its window; an evaluation only before the load leaves it so
    _wait_for_data(prom, "namespace_model_name:vllm_capacity_prefix_cache_hit:ratio >= 0", timeout=60)
    _wait_for_data(
        stack["other_prom"], 'namespace_model_name:vllm_capacity_prefix_cache_hit:ratio{k8s_cluster="east"} >= 0', 60
    )

    killed_at = time.monotonic()
    vllm.stop(signal.SIGKILL)
    path, down_at, alert = hook.wait("VLLMTargetDown", "firing", timeout=60)
    print(f"VLLMTargetDown paged {down_at - killed_at:.1f} s after vLLM was killed")
    assert path == "/pager" and alert["labels"]["pod"] == "vllm-0"
    hook.wait("VLLMTargetDown", "firing", timeout=60, cluster="east")

    # the sidecar's errors after vLLM's death reach Prometheus with its next scrapes
    _wait_for_data(prom, 'vllm_capacity_source_errors_total{source="vllm"} > 0', timeout=30)
    _wait_for_data(stack["other_prom"], 'vllm_capacity_source_errors_total{source="vllm"} > 0', timeout=30)
    unexplained = []
    for server, dashboards, cluster in (
        (prom, None, None),
        (stack["other_prom"], stack["other"]["dashboards"], "east"),
    ):
        queries = dashboard_queries(dashboards, cluster)
        with_data = queries_with_data(server, started, time.time(), queries)
        missing = [q for q in queries if q not in with_data]
        unexplained += [q for q in missing if not any(key in q for key in NO_DATA_HERE)]
        print(f"{server}: dashboard queries with data: {len(with_data)} of {len(queries)}; without, and why:")
        for q in missing:
            print(f"  {q[:100]}: {next((why for key, why in NO_DATA_HERE.items() if key in q), 'UNEXPLAINED')}")
    assert not unexplained, unexplained
