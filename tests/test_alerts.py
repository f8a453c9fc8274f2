"""The alert and recording rules: generated from one source, valid for promtool, unit-tested, routed by the
example Alertmanager configuration, and naming only metrics that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from support.promql import agent_names, load_generator, metric_names, vllm_names

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "alerts"
generate = load_generator("alerts")

RULE_FILES = [ALERTS / "vllm-capacity-alerts.yaml", ALERTS / "vllm-capacity-rules.yaml"]


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} missing: scripts/setup installs Debian's prometheus and prometheus-alertmanager"
    return path


def _alerts() -> list[dict]:
    return yaml.safe_load(RULE_FILES[0].read_text())["groups"][0]["rules"]


def _records() -> list[dict]:
    return yaml.safe_load(RULE_FILES[1].read_text())["groups"][0]["rules"]


def test_committed_rules_are_what_the_generator_makes() -> None:
    for name, text in generate.render().items():
        assert (ALERTS / name).read_text() == text, f"{name} drifted: run .venv/bin/python alerts/generate.py"


def test_promtool_check_rules() -> None:
    result = subprocess.run(
        [_tool("promtool"), "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests() -> None:
    result = subprocess.run(
        [_tool("promtool"), "test", "rules", str(ROOT / "tests" / "rules" / "alerts-test.yaml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_burn_rate_variant_fires_where_it_should(tmp_path: Path) -> None:
    """With ttftBurnRateAlerts the rules add multi-window burn-rate alerts on a TTFT objective: rendered by the
    generator, loaded by promtool, and held to tests/rules/slo-test.yaml (a fast burn pages and ends when the burn
    stops, a slow leak opens a ticket only, a quiet model pages nothing)."""
    docs = generate.documents(generate.Config(ttft_burn_rate_alerts=True))
    for name, doc in docs.items():
        (tmp_path / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / "slo-test.yaml").write_text((ROOT / "tests" / "rules" / "slo-test.yaml").read_text())
    check = subprocess.run([_tool("promtool"), "check", "rules", *map(str, sorted(tmp_path.glob("vllm-*.yaml")))])
    assert check.returncode == 0
    result = subprocess.run(
        [_tool("promtool"), "test", "rules", str(tmp_path / "slo-test.yaml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    slo = [
        r for g in docs["vllm-capacity-alerts.yaml"]["groups"] if g["name"] == "vllm-capacity-slo" for r in g["rules"]
    ]
    runbook = (ALERTS / "runbook.md").read_text()
    assert {r["alert"] for r in slo} == {"VLLMTTFTErrorBudgetBurnFast", "VLLMTTFTErrorBudgetBurnSlow"}
    assert all(f"\n## {r['alert']}\n" in runbook for r in slo)
    assert generate.documents() == generate.documents(generate.Config(ttft_burn_rate_alerts=False))  # off by default


REQUIRED = {
    "VLLMCapacityExporterDown", "VLLMCapacityTargetMissing", "VLLMTargetDown", "VLLMKVCacheHigh",
    "VLLMKVCacheSaturated",
    "VLLMPreemptionsSustained", "VLLMRequestsQueuedForCapacity", "VLLMKVCacheExhaustionPredicted",
    "VLLMConcurrencyNearCapacity", "VLLMGPUMemoryNearFull", "VLLMGPUMemoryContention", "VLLMTTFTSLOBreach",
    "VLLMCapacityMetricsMissing", "VLLMAdmissionStalled", "VLLMGPUUnreadable", "VLLMLoRASlotsExhausted",
    "VLLMRequestsShed",
}  # fmt: skip


def test_every_alert_is_complete() -> None:
    alerts = _alerts()
    assert {a["alert"] for a in alerts} == REQUIRED
    runbook = (ALERTS / "runbook.md").read_text()
    repository = tomllib.loads((ALERTS.parent / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    for a in alerts:
        assert a["labels"]["severity"] in ("critical", "warning", "info"), a["alert"]
        assert re.fullmatch(r"\d+[smh]", a["for"]), a["alert"]
        ann = a["annotations"]
        assert ann["summary"].endswith("."), a["alert"]
        assert "{{" in ann["description"], f"{a['alert']}: the description should give the values"
        assert ann["runbook_url"].startswith(f"{repository}/blob/main/alerts/runbook.md#"), a["alert"]
        # the section is headed by the alert's name, and the link is GitHub's anchor of that heading (lower case)
        assert f"\n## {a['alert']}\n" in runbook, f"runbook.md has no section {a['alert']}"
        assert ann["runbook_url"].rsplit("#", 1)[1] == a["alert"].lower(), ann["runbook_url"]
    assert {a["alert"] for a in alerts if a["labels"]["severity"] == "critical"} == {
        "VLLMTargetDown",
        "VLLMKVCacheSaturated",
        "VLLMTTFTSLOBreach",
        "VLLMAdmissionStalled",
        "VLLMRequestsShed",
    }


def test_every_alert_has_firing_and_quiet_unit_tests() -> None:
    doc = yaml.safe_load((ROOT / "tests" / "rules" / "alerts-test.yaml").read_text())
    firing, quiet = set(), set()
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    assert firing == REQUIRED
    assert quiet == REQUIRED - {"VLLMGPUMemoryNearFull", "VLLMGPUMemoryContention"} | {"VLLMKVCacheSaturated"}


def test_recording_rules_follow_level_metric_operations() -> None:
    for r in _records():
        assert re.fullmatch(r"[a-z_]+:vllm_capacity_[a-z_]+:[a-z_]+", r["record"]), r["record"]


def test_rules_name_only_metrics_that_exist() -> None:
    known = agent_names() | {r["record"] for r in _records()} | vllm_names() | {"up"}
    for rule in _alerts() + _records():
        unknown = metric_names(rule["expr"]) - known
        assert not unknown, f"{rule.get('alert') or rule.get('record')} uses unknown metrics {unknown}"


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (pod, le) (rate(vllm:time_to_first_token_seconds_bucket{job="x"}[5m])))'
        ' > on (pod) group_left vllm_capacity_up and up{a="b"} unless foo_total offset 5m'
    )
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket", "vllm_capacity_up", "up", "foo_total"}


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=critical", "alertname=VLLMKVCacheSaturated"], "pager"),
        (["severity=critical", "alertname=VLLMTargetDown"], "pager"),
        (["severity=warning", "alertname=VLLMKVCacheHigh"], "ticket"),
        (["severity=info", "alertname=Whatever"], "ticket"),
    ],
)
def test_alertmanager_routes(labels: list[str], receiver: str) -> None:
    config = str(ALERTS / "alertmanager.yaml")
    check = subprocess.run([_tool("amtool"), "check-config", config], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    route = subprocess.run(
        [
            _tool("amtool"),
            "config",
            "routes",
            "test",
            f"--config.file={config}",
            f"--verify.receivers={receiver}",
            *labels,
        ],
        capture_output=True,
        text=True,
    )
    assert route.returncode == 0, route.stdout + route.stderr


def test_target_down_inhibits_capacity_alerts() -> None:
    doc = yaml.safe_load((ALERTS / "alertmanager.yaml").read_text())
    rule = next(r for r in doc["inhibit_rules"] if r["source_matchers"] == ['alertname="VLLMTargetDown"'])
    pattern = re.search(r'alertname=~"([^"]+)"', rule["target_matchers"][0])[1]
    for name in REQUIRED - {
        "VLLMTargetDown",
        "VLLMCapacityExporterDown",
        "VLLMCapacityTargetMissing",  # no sidecar anywhere: no pod of its own to be inhibited by
        "VLLMGPUMemoryNearFull",
        "VLLMGPUMemoryContention",
        "VLLMGPUUnreadable",  # a GPU's trouble is often why vLLM is down: it must be seen
    }:
        assert re.fullmatch(pattern, name), f"VLLMTargetDown does not silence {name}"
    assert set(rule["equal"]) == {"cluster", "namespace", "pod"}
    # nothing silences the page for vLLM down (the exporter's alert used to, when its selector matched vLLM's job)
    for r in doc["inhibit_rules"]:
        targets = re.compile("|".join(re.findall(r'alertname=~?"([^"]+)"', " ".join(r["target_matchers"]))))
        excluded = any(m == 'alertname!="VLLMTargetDown"' for m in r["target_matchers"])
        assert not targets.fullmatch("VLLMTargetDown") or excluded, r


def test_inhibitions_and_grouping_keep_clusters_apart() -> None:
    """With several clusters in one Alertmanager, vLLM down in one cluster never silences a same-named pod's alerts
    in another, and one notification never mixes clusters (a missing label is one cluster: equal as empty)."""
    doc = yaml.safe_load((ALERTS / "alertmanager.yaml").read_text())
    assert all("cluster" in rule["equal"] for rule in doc["inhibit_rules"])
    assert "cluster" in doc["route"]["group_by"]
