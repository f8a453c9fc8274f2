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


def annotation_exprs(d: dict) -> list[str]:
    """The PromQL of a dashboard's annotations (vLLM's restarts): checked as its queries are, but not among them for
    the end-to-end stack, whose vLLM never restarts while it looks."""
    return [a["expr"] for a in d.get("annotations", {}).get("list", []) if "expr" in a]


def promql_for_promtool(expr: str) -> str:
    """Grafana's variables as Prometheus would see them once Grafana substituted them."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    expr = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", ".*", expr)  # not label_replace's $1
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
        for i, e in enumerate(exprs(_dashboard(name)) + annotation_exprs(_dashboard(name)))
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_latency_bars_come_in_numeric_order_of_running(tmp_path: Path) -> None:
    """The curve's bars, one per running-requests bin: Prometheus sorts series by their labels as text (1, 12, 2),
    so the query pads ``running`` into ``bin``, which sorts first. Evaluated by Prometheus' own engine (promtool)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/setup installs Debian's prometheus package"
    (panel,) = [p for p in _panels(_dashboard("vllm-capacity.json")) if p["title"].startswith("Latency vs running")]
    expr = promql_for_promtool(panel["targets"][0]["expr"])
    running = [1, 2, 9, 10, 12, 99, 100, 512, 1024, 99999, 123456]
    series = 'vllm_capacity_latency_by_concurrency_seconds{latency="itl",percentile="p90",running="%d",pod="a"}'
    padded = {r: f"{r:06d}" for r in running if r < 100_000}

    def labels(r: int) -> str:
        return f'{{running="{r}"' + (f',bin="{padded[r]}"' if r in padded else "") + "}"

    test = {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": series % r, "values": f"{r / 1000}"} for r in running],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "0m",
                        "exp_samples": [{"labels": labels(r), "value": r / 1000} for r in running],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "order.yaml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # Prometheus orders series by label name, then value: bin before running; a series without bin (six digits
    # and more) sorts after every series with one
    by_labels = sorted(running, key=lambda r: (0, padded[r]) if r in padded else (1, str(r)))
    assert by_labels == sorted(running)


def test_every_query_names_only_metrics_that_exist() -> None:
    records = {
        r["record"]
        for r in yaml.safe_load((ROOT / "alerts" / "vllm-capacity-rules.yaml").read_text())["groups"][0]["rules"]
    }
    # and vLLM's own process metrics (prometheus-client's process collector, in a capture of a real vLLM 0.32)
    captured = (ROOT / "tests" / "fixtures" / "vllm" / "v1-0.32.0-cpu-idle.prom").read_text()
    known = agent_names() | records | vllm_names() | set(re.findall(r"^(process_\w+) ", captured, re.M))
    for name in NAMES:
        for e in exprs(_dashboard(name)) + annotation_exprs(_dashboard(name)):
            unknown = metric_names(promql_for_promtool(e)) - known
            assert not unknown, f"{name}: {e} uses unknown metrics {unknown}"


@pytest.mark.parametrize("name", NAMES)
def test_every_query_keeps_to_the_selected_cluster(name: str) -> None:
    """Each label matcher set that picks a namespace also picks the cluster (the cluster variable), and every
    variable's values are those of the selected clusters: with several clusters in one Prometheus (Thanos, Mimir)
    a panel never mixes clusters the user did not select."""
    d = _dashboard(name)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    # Grafana leaves a $name it has no variable for as it is: label_replace's $1 is PromQL's
    used = {m for e in exprs(d) for m in re.findall(r"\$\{?([A-Za-z_]\w*)", e)} - {"__rate_interval", "__interval"}
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


# Grafana's units (grafana-data's valueFormats/categories.ts) the dashboards use
GRAFANA_UNITS = {"short", "none", "percent", "percentunit", "bytes", "decbytes", "s", "ms", "reqps", "ops", "watt",
                 "celsius", "hertz", "rothz", "bool", "bool_on_off", "cps"}  # fmt: skip
COUNTER_FUNCTIONS = ("rate(", "irate(", "increase(", "resets(", "changes(")


def _enclosing_function(expr: str, at: int) -> str:
    """The function call (``rate(``) whose parentheses hold position ``at`` of ``expr``, "" at the top level."""
    depth = 0
    for i in range(at - 1, -1, -1):
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(":
            if depth == 0:
                return re.search(r"(\w*)\s*$", expr[:i])[1] + "("  # type: ignore[index]
            depth -= 1
    return ""


def lint(d: dict) -> dict[str, list[str]]:
    """A faithful subset of grafana's dashboard-linter rules (github.com/grafana/dashboard-linter), by rule name:
    the problems found. target-promql-rule is test_every_query_parses_in_prometheus (promtool)."""
    found: dict[str, list[str]] = {}

    def problem(rule: str, what: str) -> None:
        found.setdefault(rule, []).append(what)

    variables = d["templating"]["list"]
    sources = [v for v in variables if v["type"] == "datasource"]
    if [(v["name"], v.get("label"), v["query"]) for v in sources] != [("datasource", "Data source", "prometheus")]:
        problem("template-datasource-rule", f"datasource variables: {sources}")
    names = {v["name"] for v in variables}
    if "job" not in names:
        problem("template-job-rule", "no job variable")
    if "instance" not in names:
        problem("template-instance-rule", "no instance variable")
    for v in variables:
        if v["type"] == "query":
            query = v["query"] if isinstance(v["query"], str) else v["query"]["query"]
            if not re.fullmatch(r"label_values\(.+, *\w+\)", query):
                problem("template-label-promql-rule", f"{v['name']}: {query}")
            if v.get("refresh") != 2:
                problem("template-on-time-change-reload-rule", v["name"])
    if d.get("editable") is not False:
        problem("template-uneditable-rule", "editable")
    for p in _panels(d):
        title = p.get("title", "")
        if p.get("datasource", {}).get("uid") != "${datasource}":
            problem("panel-datasource-rule", title)
        if not title or not p.get("description"):
            problem("panel-title-description-rule", title)
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        unit_shown = p["type"] in ("stat", "timeseries", "gauge", "table") and not defaults.get("mappings")
        if unit_shown and defaults.get("unit") not in GRAFANA_UNITS:
            problem("panel-units-rule", f"{title}: {defaults.get('unit')}")
        if not p.get("targets"):
            problem("panel-no-targets-rule", title)
        for t in p.get("targets", []):
            expr = t["expr"]
            if re.search(r"\b(?:rate|irate|increase)\([^\[]*\[(?!\$__rate_interval\])", expr):
                problem("target-rate-interval-rule", f"{title}: {expr}")
            if 'job=~"$job"' not in expr:
                problem("target-job-rule", title)
            if 'instance=~"$instance"' not in expr:
                problem("target-instance-rule", title)
            for counter in re.finditer(r"\b\w+_total\b(?!_)", expr):
                if _enclosing_function(expr, counter.start()) not in COUNTER_FUNCTIONS:
                    problem("target-counter-agg-rule", f"{title}: {counter[0]} outside rate/increase")
    return found


@pytest.mark.parametrize("name", NAMES)
def test_the_dashboards_pass_grafanas_linter_rules(name: str) -> None:
    """Every rule holds, but those dashboards/.lint excludes, each with its reason (the linter's own format)."""
    exclusions = yaml.safe_load((ROOT / "dashboards" / ".lint").read_text())["exclusions"]
    assert all(len(e.get("reason", "")) > 20 for e in exclusions.values()), "an exclusion needs its reason"
    found = lint(_dashboard(name))
    assert {rule: what for rule, what in found.items() if rule not in exclusions} == {}
    assert set(exclusions) <= set(found), "an exclusion no rule needs any more"


def test_the_linter_finds_what_it_is_for() -> None:
    """Each rule fails on a dashboard that breaks it."""
    d = _dashboard("vllm-capacity.json")
    broken = json.loads(json.dumps(d))
    broken["editable"] = True
    panel = _panels(broken)[1]
    del panel["description"]
    panel["fieldConfig"]["defaults"]["unit"] = "tokens"
    panel["datasource"] = {"type": "prometheus", "uid": "prom"}
    panel["targets"][0]["expr"] = "sum(rate(vllm_capacity_preemptions_total[5m])) + vllm_capacity_preemptions_total"
    found = lint(broken)
    for rule in ("template-uneditable-rule", "panel-title-description-rule", "panel-units-rule",
                 "panel-datasource-rule", "target-rate-interval-rule", "target-counter-agg-rule"):  # fmt: skip
        assert rule in found, rule
    assert set(lint(d)) == {"template-job-rule", "template-instance-rule", "target-job-rule", "target-instance-rule"}
