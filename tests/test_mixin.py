"""The monitoring mixin (deploy/mixin): rendered by jsonnet, it gives exactly the rules and dashboards the repository
ships for the default _config, and valid, tested ones for another: its promtool rule tests pass on the rendered
rules with every series in two clusters (a rule that forgets the cluster label sums, joins or alerts across them and
fails), and its dashboards keep to the selected cluster. deploy/generate.py writes the mixin; test_deploy.py holds the
committed copy to it."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import _jsonnet
import pytest
import yaml

from support.promql import MIXIN, OTHER_CONFIG, load_generator, render_mixin
from test_dashboards import exprs, promql_for_promtool

ROOT = Path(__file__).resolve().parents[1]
RULE_TESTS = ROOT / "tests" / "rules" / "alerts-test.yaml"
CLUSTERS = ("east", "west")
alerts_generate = load_generator("alerts")
DEFAULTS = alerts_generate.DEFAULT.jsonnet()


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool missing: scripts/setup installs Debian's prometheus package"
    return path


def test_the_default_config_renders_exactly_what_ships() -> None:
    m = render_mixin()
    assert m["alerts"] == yaml.safe_load((ROOT / "alerts" / "vllm-capacity-alerts.yaml").read_text())
    assert m["rules"] == yaml.safe_load((ROOT / "alerts" / "vllm-capacity-rules.yaml").read_text())
    assert set(m["dashboards"]) == {"vllm-capacity.json", "vllm-capacity-fleet.json"}
    for name, dashboard in m["dashboards"].items():
        assert dashboard == json.loads((ROOT / "dashboards" / name).read_text()), name


def test_the_burn_rate_variant_renders_as_the_generator_makes_it() -> None:
    """ttftBurnRateAlerts adds the SLO groups after the shipped ones, with the objective and target given."""
    settings = {"ttftBurnRateAlerts": True, "ttftObjectiveLe": "5.0", "ttftSloTarget": 0.995}
    m = render_mixin(settings)
    docs = alerts_generate.documents(
        alerts_generate.Config(ttft_burn_rate_alerts=True, ttft_objective_le="5.0", ttft_slo_target=0.995)
    )
    assert m["alerts"] == docs["vllm-capacity-alerts.yaml"] and m["rules"] == docs["vllm-capacity-rules.yaml"]
    assert [g["name"] for g in m["alerts"]["groups"]] == ["vllm-capacity", "vllm-capacity-slo"]
    assert 'le="5.0"' in str(m["rules"]) and "(14.4 * (1 - 0.995))" in str(m["alerts"])


def test_the_mixin_is_a_jsonnet_bundler_package() -> None:
    bundle = json.loads((MIXIN / "jsonnetfile.json").read_text())
    assert bundle["version"] == 1 and bundle["dependencies"] == []  # nothing to vendor: plain jsonnet, no libraries
    text = (MIXIN / "mixin.libsonnet").read_text()
    for part in ("config", "alerts", "rules", "dashboards"):
        assert f"(import '{part}.libsonnet')" in text
    # every field of the mixin's _config is one of alerts/generate.py's Config, and the defaults agree
    rendered = json.loads(_jsonnet.evaluate_snippet("c", "(import 'mixin.libsonnet')._config", jpathdir=[str(MIXIN)]))
    assert rendered == DEFAULTS


class _RuleTestLoader(yaml.SafeLoader):
    """YAML as promtool's Go decoder reads its test files: ``values: 0x15`` is a series notation (0 fifteen times),
    not the hexadecimal number PyYAML's YAML 1.1 resolver makes of it."""


_RuleTestLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RuleTestLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))


def _rule_tests() -> dict:
    return yaml.load(RULE_TESTS.read_text(), Loader=_RuleTestLoader)  # noqa: S506 - a SafeLoader with fewer ints


def _relabel(series: str, label: str, cluster: str, job: str) -> str:
    """``name{a="b"}`` with ``label="cluster"`` added and the sidecar's job renamed."""
    series = re.sub(r'job="([^"]*?)vllm-capacity"', rf'job="\g<1>{job}"', series)
    name, brace, rest = series.partition("{")
    return f'{name}{{{label}="{cluster}"' + ("," + rest if brace and rest != "}" else "}")


# alerts on a series that is absent: absent() keeps only the equality matchers of its selector as labels, so it
# says "none anywhere" once, with no cluster label (a Prometheus per cluster is where it tells clusters apart)
ABSENT_ALERTS = {"VLLMCapacityTargetMissing"}


def _absent_alert(expected: dict, config: dict) -> dict:
    a = copy.deepcopy(expected)
    equal = re.fullmatch(r'job="([^"]*)"', config["exporterSelector"])
    if equal:
        a["exp_labels"]["job"] = equal[1]
    else:
        a["exp_labels"].pop("job", None)
    notes = a["exp_annotations"]
    notes["description"] = re.sub(
        r"no sidecar of job [^:]*:", f"no sidecar of job {equal[1]}:" if equal else "no sidecar:", notes["description"]
    )
    notes["runbook_url"] = notes["runbook_url"].replace(DEFAULTS["runbookURL"], config["runbookURL"])
    return a


def _in_two_clusters(tests: dict, rule_files: list[str], config: dict) -> dict:
    """The promtool tests with every input series in two clusters (the same values in each) and every expected
    alert and sample expected once per cluster, the sidecar's job and the runbook address as ``config`` has them."""
    label = config["clusterLabel"]
    job = "gpu-sidecar" if "gpu-sidecar" in config["exporterSelector"] else "vllm-capacity"
    doc = copy.deepcopy(tests)
    doc["rule_files"] = rule_files
    for t in doc["tests"]:
        t["input_series"] = [
            {**s, "series": _relabel(s["series"], label, c, job)} for s in t["input_series"] for c in CLUSTERS
        ]
        for case in t.get("alert_rule_test", []):
            expected = []
            if case["alertname"] in ABSENT_ALERTS:  # absent(): no cluster, and a job only from an equality
                case["exp_alerts"] = [_absent_alert(a, config) for a in case.get("exp_alerts") or []]
                continue
            for a in case.get("exp_alerts") or []:
                for c in CLUSTERS:
                    a2 = copy.deepcopy(a)
                    labels = a2["exp_labels"]
                    labels[label] = c
                    if "job" in labels:
                        labels["job"] = labels["job"].replace("vllm-capacity", job)
                    notes = a2.get("exp_annotations", {})
                    if "runbook_url" in notes:
                        notes["runbook_url"] = notes["runbook_url"].replace(
                            DEFAULTS["runbookURL"], config["runbookURL"]
                        )
                    expected.append(a2)
            case["exp_alerts"] = expected
        for case in t.get("promql_expr_test", []):
            case["exp_samples"] = [
                {**s, "labels": _relabel(s["labels"], label, c, job)} for s in case["exp_samples"] for c in CLUSTERS
            ]
    return doc


@pytest.mark.parametrize("config", [DEFAULTS, {**DEFAULTS, **OTHER_CONFIG}], ids=["default", "other"])
def test_rendered_rules_pass_promtool_and_the_rule_tests_in_two_clusters(tmp_path: Path, config: dict) -> None:
    m = render_mixin(config)
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(m["alerts"]))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(m["rules"]))
    check = subprocess.run(
        [_promtool(), "check", "rules", str(tmp_path / "alerts.yaml"), str(tmp_path / "rules.yaml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = _in_two_clusters(_rule_tests(), ["alerts.yaml", "rules.yaml"], config)
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False, width=1000))
    result = subprocess.run([_promtool(), "test", "rules", "tests.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_transform_would_catch_a_rule_that_forgets_the_cluster(tmp_path: Path) -> None:
    """The two-cluster rule tests fail when one recording rule sums across clusters: the check above has teeth."""
    m = render_mixin(OTHER_CONFIG)
    for rule in m["rules"]["groups"][0]["rules"]:
        if rule["record"] == "namespace_model_name:vllm_capacity_replicas:count":
            rule["expr"] = rule["expr"].replace("k8s_cluster, ", "")
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(m["alerts"]))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(m["rules"]))
    tests = _in_two_clusters(_rule_tests(), ["alerts.yaml", "rules.yaml"], {**DEFAULTS, **OTHER_CONFIG})
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False, width=1000))
    result = subprocess.run([_promtool(), "test", "rules", "tests.yaml"], capture_output=True, text=True, cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert 'got: {__name__="namespace_model_name:vllm_capacity_replicas:count", model_name="m"' in out, out[-3000:]


def test_rendered_dashboards_keep_to_the_configured_cluster_label(tmp_path: Path) -> None:
    m = render_mixin(OTHER_CONFIG)
    rules = []
    for name, d in m["dashboards"].items():
        cluster = next(v for v in d["templating"]["list"] if v["name"] == "cluster")
        assert cluster["hide"] == 0, name  # showMultiCluster: the selector shows
        query = cluster["query"]["query"] if isinstance(cluster["query"], dict) else cluster["query"]
        assert query == "label_values(vllm_capacity_up, k8s_cluster)", name
        for e in exprs(d):
            assert not re.search(r"(?<![\w])cluster=", e), e  # the default label is gone everywhere
            for matchers in re.findall(r"\{([^{}]*)\}", e):
                if "namespace=" in matchers:
                    assert 'k8s_cluster=~"$cluster"' in matchers, e
            rules.append({"record": f"dashboard:query_{len(rules)}:check", "expr": promql_for_promtool(e)})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    result = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_thresholds_reach_rules_and_dashboards() -> None:
    m = render_mixin({"kvCacheHighRatio": 0.85, "exhaustionHorizonSeconds": 7200, "targetUtilization": 0.7})
    rules = {r.get("alert") or r["record"]: r for g in (m["alerts"], m["rules"]) for r in g["groups"][0]["rules"]}
    assert "vllm_capacity_kv_cache_usage_ratio > 0.85 unless" in rules["VLLMKVCacheHigh"]["expr"]
    assert "(vllm_capacity_kv_cache_usage_ratio < 0.85)" in rules["VLLMAdmissionStalled"]["expr"]
    assert ", 7200) >" in rules["VLLMKVCacheExhaustionPredicted"]["expr"]
    assert rules["VLLMKVCacheExhaustionPredicted"]["annotations"]["description"].endswith("within 120 minutes.")
    assert rules["namespace_model_name:vllm_capacity_replicas_needed:ceil"]["expr"].endswith("* 0.7 > 0)), 1)")
    titles = [p["title"] for p in m["dashboards"]["vllm-capacity.json"]["panels"]]
    assert "KV cache exhaustion forecast (2 h ahead)" in titles


def test_the_dashboard_settings_kube_prometheus_users_set_reach_the_dashboards() -> None:
    """grafanaDashboardFolder (read by kube-prometheus from the mixin's top level), dashboardTags, dashboardTimezone,
    dashboardRefresh and grafanaDashboardIDs: the names kubernetes-mixin and node-mixin give them."""
    ids = {"vllm-capacity.json": "gpu-kv", "vllm-capacity-fleet.json": "gpu-kv-fleet"}
    config = {"dashboardTags": ["inference"], "dashboardTimezone": "utc", "dashboardRefresh": "1m",
              "grafanaDashboardIDs": ids, "grafanaDashboardFolder": "Inference"}  # fmt: skip
    m = render_mixin(config)
    for name, dashboard in m["dashboards"].items():
        assert dashboard["uid"] == ids[name]
        assert (dashboard["tags"], dashboard["timezone"], dashboard["refresh"]) == (["inference"], "utc", "1m")
    folder = _jsonnet.evaluate_snippet(
        "f",
        "((import 'mixin.libsonnet') + { _config+:: { grafanaDashboardFolder: 'Inference' } }).grafanaDashboardFolder",
        jpathdir=[str(MIXIN)],
    )
    assert json.loads(folder) == "Inference"
    shipped = render_mixin()["dashboards"]
    assert {name: d["uid"] for name, d in shipped.items()} == DEFAULTS["grafanaDashboardIDs"]
    assert all(d["tags"] == DEFAULTS["dashboardTags"] for d in shipped.values())
