"""The Grafana dashboards: generated from dashboards/generate.py, complete, and querying only metrics that exist
with PromQL that Prometheus accepts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from support.promql import agent_names, load_generator, metric_names, vllm_names

ROOT = Path(__file__).resolve().parents[1]
dashboards_generate = load_generator("dashboards")

NAMES = ("vllm-capacity.json", "vllm-capacity-fleet.json")


def _dashboard(name: str) -> dict:
    return json.loads((ROOT / "dashboards" / name).read_text())


def _panels(d: dict) -> list[dict]:
    return [p for p in d["panels"] if p["type"] != "row"]


def exprs(d: dict) -> list[str]:
    return [t["expr"] for p in _panels(d) for t in p["targets"]] + [
        v["query"] if isinstance(v["query"], str) else v["query"]["query"]
        for v in d["templating"]["list"]
        if v["type"] == "query"
    ]


def promql_for_promtool(expr: str) -> str:
    """Grafana's variables as Prometheus would see them once Grafana substituted them."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    expr = re.sub(r"\$\{?(\w+)\}?", ".*", expr)
    m = re.fullmatch(r"label_values\((.+), *\w+\)", expr)  # a variable's query: its selector is the PromQL
    return m[1] if m else expr


def test_committed_json_is_what_the_generator_makes() -> None:
    for name, text in dashboards_generate.render().items():
        assert (ROOT / "dashboards" / name).read_text() == text, f"{name} drifted: run dashboards/generate.py"


@pytest.mark.parametrize("name", NAMES)
def test_dashboard_structure(name: str) -> None:
    d = _dashboard(name)
    assert d["uid"] in ("vllm-capacity", "vllm-capacity-fleet")
    assert d["schemaVersion"] >= 41
    assert "vllm-capacity" in d["tags"]
    ids = [p["id"] for p in d["panels"]]
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    variables = [v["name"] for v in d["templating"]["list"]]
    assert variables == (
        ["datasource", "cluster", "namespace", "pod", "model"]
        if name == NAMES[0]
        else ["datasource", "cluster", "namespace", "model"]
    )
    cluster = d["templating"]["list"][1]
    assert cluster["hide"] == 2 and cluster["allValue"] == ".*"  # hidden by default; All matches a missing label
    for p in _panels(d):
        defaults = p["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{p['title']}: no unit"
        assert defaults.get("thresholds", {}).get("steps"), f"{p['title']}: no thresholds"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert isinstance(p["id"], int) and p["id"] > 0, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs) and all(refs), f"{p['title']}: refIds {refs}"


def test_capacity_dashboard_has_what_operators_plan_with() -> None:
    titles = {p["title"] for p in _panels(_dashboard(NAMES[0]))}
    for needed in (
        "GPU memory by what holds it",
        "KV cache tokens",
        "Bytes per token (per GPU rank)",
        "Running requests against max concurrency",
        "Concurrency utilization",
        "KV cache exhaustion forecast (1 h ahead)",
        "Waiting and preempted",
        "Time to first token",
        "Time per output token (inter-token latency)",
        "Saturation: p99 TTFT and running requests",
        "GPU utilization",
        "GPU power",
        "GPU throttling",
        "Prefix cache hit ratio",
        "Headroom: requests it can still take",
        "What limits concurrency now",
        "Latency vs running requests (learned)",
    ):
        assert needed in titles, needed
    fleet = {p["title"] for p in _panels(_dashboard(NAMES[1]))}
    assert "Replicas: running and needed" in fleet


def test_every_query_parses_in_prometheus(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/setup installs Debian's prometheus package"
    rules = [
        {"record": f"dashboard:query_{i}:check", "expr": promql_for_promtool(e)}
        for name in NAMES
        for i, e in enumerate(exprs(_dashboard(name)))
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_query_names_only_metrics_that_exist() -> None:
    records = {
        r["record"]
        for r in yaml.safe_load((ROOT / "alerts" / "vllm-capacity-rules.yaml").read_text())["groups"][0]["rules"]
    }
    known = agent_names() | records | vllm_names()
    for name in NAMES:
        for e in exprs(_dashboard(name)):
            unknown = metric_names(promql_for_promtool(e)) - known
            assert not unknown, f"{name}: {e} uses unknown metrics {unknown}"


@pytest.mark.parametrize("name", NAMES)
def test_every_query_keeps_to_the_selected_cluster(name: str) -> None:
    """Each label matcher set that picks a namespace also picks the cluster (the cluster variable), and every
    variable's values are those of the selected clusters: with several clusters in one Prometheus (Thanos, Mimir)
    a panel never mixes clusters the user did not select."""
    d = _dashboard(name)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    used = {m for e in exprs(d) for m in re.findall(r"\$\{?(\w+)", e)} - {"__rate_interval", "__interval"}
    assert used <= set(variables), used - set(variables)
    for e in exprs(d):
        for matchers in re.findall(r"\{([^{}]*)\}", e):
            if "namespace=" in matchers or "namespace!" in matchers:
                assert 'cluster=~"$cluster"' in matchers, e


def _unit_of(panel: dict, target: dict) -> str:
    """The unit a target is drawn in: an override by its legend, else the panel's."""
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        if o["matcher"] == {"id": "byName", "options": target.get("legendFormat")}:
            for prop in o["properties"]:
                if prop["id"] == "unit":
                    return prop["value"]
    return panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")


@pytest.mark.parametrize("name", NAMES)
def test_every_series_is_drawn_in_its_own_unit(name: str) -> None:
    """A request count is not seconds, and a per-second rate is not a count: on an axis in seconds only series in
    seconds (latencies, their quantiles), and a rate of a counter never on a count's axis. (The knee, a request
    count, once sat on the latency panel's seconds axis; preemptions/s on the waiting requests'.) A ratio of two
    rates is a plain number."""
    wrong = []
    for panel in _panels(_dashboard(name)):
        for t in panel["targets"]:
            unit, expr = _unit_of(panel, t), t["expr"]
            in_seconds = "_seconds" in expr or "histogram_quantile" in expr
            if (unit == "s") != in_seconds:
                wrong.append(f"{panel['title']}: {t.get('legendFormat')} ({unit})")
            elif expr.count("rate(") == 1 and "histogram_quantile" not in expr and unit in ("short", "none"):
                wrong.append(f"{panel['title']}: {t.get('legendFormat')} is a rate drawn as a count")
    assert not wrong, wrong
