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


def _evaluate(tmp_path: Path, series: dict[str, float], tests: list[tuple[str, list[tuple[str, float]]]]) -> None:
    """Each (dashboard query, [(labels, value)...]) as Prometheus' own engine (promtool test rules) evaluates it over
    ``series`` (each a constant), Grafana's variables at All; an empty list: no sample at all."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/setup installs Debian's prometheus package"
    test = {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": f"{value:.17g}x10"} for name, value in series.items()],
                "promql_expr_test": [
                    {
                        "expr": promql_for_promtool(expr),
                        "eval_time": "5m",
                        "exp_samples": [{"labels": labels, "value": value} for labels, value in samples],
                    }
                    for expr, samples in tests
                ],
            }
        ],
    }
    path = tmp_path / "evaluate.yaml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _panel(title: str) -> dict:
    (panel,) = [p for p in _panels(_dashboard(NAMES[0])) if p["title"] == title]
    return panel


def _by_legend(panel: dict) -> dict[str, str]:
    return {t["legendFormat"]: t["expr"] for t in panel["targets"]}


def _lines(panel: dict) -> set[str]:
    """The legends an override draws as unstacked lines, beside the stack rather than on it."""
    out = set()
    for o in panel["fieldConfig"]["overrides"]:
        if any(p["id"] == "custom.stacking" and p["value"]["mode"] == "none" for p in o["properties"]):
            assert o["matcher"]["id"] == "byRegexp", o
            out |= {legend for legend in _by_legend(panel) if re.fullmatch(o["matcher"]["options"], legend)}
    return out


MiB = 2**20
# the seed's A10G (15.18, 0.78, 0.27 and 4.31 GiB), in whole MiB: Prometheus' sums are then exact
SEED = {"weights": 15544, "CUDA graphs": 799, "activations (peak)": 276, "KV cache": 4413}


def test_the_memory_budget_is_drawn_as_the_seed_draws_it_from_whichever_sources_exist(tmp_path: Path) -> None:
    """Both budget panels draw the seed's parts (weights, CUDA graphs, activations, KV cache, other processes, free)
    by the same queries; the budget over time is a line beside the stack, not a layer on it. Without NVML the parts
    come from vLLM's startup log alone; with NVML its vllm_runtime loses the graphs and the activations the log
    names, and the parts add up to the GPU's memory. The row repeats per pod: a stack is one pod's GPU."""
    bars, over_time = _panel("GPU memory by what holds it"), _panel("GPU memory over time")
    parts = _by_legend(bars)
    assert {"weights", "CUDA graphs", "activations (peak)", "KV cache", "other processes", "free"} <= set(parts)
    assert {k: v for k, v in _by_legend(over_time).items() if k in parts} == parts
    budget = [legend for legend in _by_legend(over_time) if legend not in parts]
    assert budget == ["vLLM budget (gpu_memory_utilization)"] and _lines(over_time) == set(budget)
    assert over_time["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    (row,) = [p for p in _dashboard(NAMES[0])["panels"] if p["type"] == "row" and p["title"].startswith("GPU memory")]
    assert row["repeat"] == "pod"

    engine = 'model_name="m",engine="0",pod="p",namespace="n"'
    log = {
        f"vllm_capacity_model_weights_bytes{{{engine}}}": SEED["weights"] * MiB,
        f"vllm_capacity_cuda_graph_bytes{{{engine}}}": SEED["CUDA graphs"] * MiB,
        f"vllm_capacity_activation_peak_bytes{{{engine}}}": SEED["activations (peak)"] * MiB,
        f"vllm_capacity_kv_cache_pool_bytes{{{engine}}}": SEED["KV cache"] * MiB,
    }
    expected = {legend: [("{}", mib * MiB)] for legend, mib in SEED.items()}
    _evaluate(tmp_path, log, [(expr, expected.get(legend, [])) for legend, expr in parts.items()])

    # with NVML, two GPUs of a TP-2 pod (their ranks alike but for free memory): the mean GPU
    nvml = {"weights": 15544, "kv_cache": 4413, "vllm_runtime": 1311, "other_processes": 512, "system": 256}
    gpus = {}
    for gpu, free in (("0", 512), ("1", 716)):
        for component, mib in {**nvml, "free": free}.items():
            gpus[f'vllm_capacity_gpu_memory_bytes{{gpu="{gpu}",pod="p",namespace="n",component="{component}"}}'] = (
                mib * MiB
            )
    want = {
        "weights": 15544,
        "CUDA graphs": 799,
        "activations (peak)": 276,
        "KV cache": 4413,
        "CUDA context and other runtime": 1311 - 799 - 276,
        "other processes": 512,
        "driver-reserved": 256,
        "free": 614,
    }
    assert set(want) == set(parts)
    assert sum(want.values()) == sum(nvml.values()) + 614  # the mean GPU's memory: nothing counted twice or left out
    _evaluate(tmp_path, {**log, **gpus}, [(expr, [("{}", want[legend] * MiB)]) for legend, expr in parts.items()])


def test_the_saturation_curve_is_throughput_and_latency_against_running_with_the_knee(tmp_path: Path) -> None:
    """One view of the seed's section 22: output tokens/s, requests/s and p99 ITL, each against running requests
    (the queries joined by time into one frame), and the SLO knee marked at its running requests on the
    throughput curve; beside the learned latency bars."""
    panel = _panel("Saturation curve: throughput and latency against running requests")
    assert panel["type"] == "xychart" and panel["options"]["mapping"] == "manual"
    assert panel["transformations"] == [{"id": "joinByField", "options": {"byField": "Time", "mode": "outer"}}]
    legends = _by_legend(panel)
    pairs = {(s["x"]["matcher"]["options"], s["y"]["matcher"]["options"]) for s in panel["options"]["series"]}
    assert all(x in legends and y in legends for x, y in pairs), pairs
    running = next(legend for legend, e in legends.items() if e.startswith("sum(vllm_capacity_requests_running"))
    knee = next(legend for legend, e in legends.items() if 'basis="slo"' in e)
    tokens = next(legend for legend, e in legends.items() if "generation_tokens_total" in e)
    requests = next(legend for legend, e in legends.items() if "request_success_total" in e)
    itl_p99 = next(legend for legend, e in legends.items() if "histogram_quantile(0.99" in e)
    assert pairs == {(running, tokens), (running, requests), (running, itl_p99), (knee, tokens)}
    bars = _panel("Latency vs running requests (learned)")
    assert (panel["gridPos"]["y"], panel["gridPos"]["x"]) == (bars["gridPos"]["y"], bars["gridPos"]["x"] + 12)
    # the throughput queries are rates of vLLM's own counters: 600 tokens and 6 requests a minute
    engine = 'model_name="m",engine="0",pod="p"'
    promtool = shutil.which("promtool")
    assert promtool
    test = {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": f"vllm:generation_tokens_total{{{engine}}}", "values": "0+600x10"},
                    {"series": f"vllm:request_success_total{{{engine}}}", "values": "0+6x10"},
                ],
                "promql_expr_test": [
                    {"expr": promql_for_promtool(legends[tokens]).replace("[5m]", "[2m]"), "eval_time": "5m",
                     "exp_samples": [{"labels": "{}", "value": 10}]},
                    {"expr": promql_for_promtool(legends[requests]).replace("[5m]", "[2m]"), "eval_time": "5m",
                     "exp_samples": [{"labels": "{}", "value": 0.1}]},
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "rates.yaml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_kv_cache_tokens_are_the_block_pool(tmp_path: Path) -> None:
    """Used and free tokens stacked up to the capacity line, and the blocks one request holds (at the mean context
    of running requests, at max_model_len: tokens / block_size rounded up) on the right axis, unstacked."""
    panel = _panel("KV cache tokens")
    legends = _by_legend(panel)
    assert set(legends) == {"used", "free", "capacity", "blocks per running request",
                            "blocks per max_model_len request"}  # fmt: skip
    assert _lines(panel) == set(legends) - {"used", "free"}
    assert all(_unit_of(panel, t) == "short" for t in panel["targets"])
    engine = 'model_name="m",engine="0",pod="p"'
    _evaluate(
        tmp_path,
        {
            f"vllm_capacity_kv_cache_capacity_tokens{{{engine}}}": 208625,
            f"vllm_capacity_kv_cache_used_tokens{{{engine}}}": 200000,
            f"vllm_capacity_kv_cache_free_tokens{{{engine}}}": 8625,
            f"vllm_capacity_mean_context_tokens{{{engine}}}": 4000.5,
            f"vllm_capacity_max_model_len_tokens{{{engine}}}": 32768,
            f"vllm_capacity_kv_cache_block_size_tokens{{{engine}}}": 16,
        },
        [
            (legends["used"], [("{}", 200000)]),
            (legends["free"], [("{}", 8625)]),
            (legends["capacity"], [("{}", 208625)]),
            (legends["blocks per running request"], [("{}", 251)]),
            (legends["blocks per max_model_len request"], [("{}", 2048)]),
        ],
    )


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
    """The unit a target is drawn in: the last override that matches its series by name or regex (as Grafana
    matches a display name: the legend, each {{label}} a value), else the panel's."""
    shown = re.sub(r"\{\{\s*\w+\s*\}\}", "0", target.get("legendFormat", ""))
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        kind, pattern = o["matcher"]["id"], o["matcher"].get("options", "")
        if (kind == "byName" and pattern == shown) or (kind == "byRegexp" and re.fullmatch(pattern, shown)):
            unit = next((prop["value"] for prop in o["properties"] if prop["id"] == "unit"), unit)
    return unit


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
