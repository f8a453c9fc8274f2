"""The metric catalogue follows Prometheus naming conventions, and docs/metrics.md documents exactly it."""

import json
import re
from pathlib import Path

import pytest
import yaml

from support.promql import metric_names
from test_dashboards import annotation_exprs, exprs, promql_for_promtool
from vllm_capacity.exposition.catalogue import SPECS
from vllm_capacity.sources import Reason

UNIT_SUFFIXES = ("_bytes", "_seconds", "_tokens", "_ratio", "_total", "_info", "_celsius", "_watts", "_hertz")
UNITLESS = {  # counts and states without a base unit
    "vllm_capacity_up",
    "vllm_capacity_source_up",
    "vllm_capacity_kv_cache_blocks",
    "vllm_capacity_max_concurrency",
    "vllm_capacity_requests_running",
    "vllm_capacity_requests_waiting",
    "vllm_capacity_requests_waiting_for_capacity",
    "vllm_capacity_requests_swapped",
    "vllm_capacity_gpu_throttled",  # a 0/1 state per reason
    "vllm_capacity_gpu_up",  # 0/1
    "vllm_capacity_gpu_clock_event",  # a 0/1 state per reason
    "vllm_capacity_kv_cache_bytes_per_token",  # a per-token unit, like the 21.7 KiB per token of the worked example
    "vllm_capacity_headroom_requests",
    "vllm_capacity_requests_waiting_deferred",
    "vllm_capacity_concurrency_limit",  # a 0/1 state per limit
    "vllm_capacity_engine_asleep",  # a 0/1 state
    "vllm_capacity_slo_knee_observed",  # a 0/1 state
    "vllm_capacity_sustained_queue_observed",  # a 0/1 state
    "vllm_capacity_latency_by_concurrency_observations",
    "vllm_capacity_kv_cache_groups",  # a count per layer kind
    "vllm_capacity_kv_cache_blocks_per_request",  # blocks, like kv_cache_blocks
    "vllm_capacity_kv_cache_plan_mismatch",  # a 0/1 state
    "vllm_capacity_lora_slots",  # a count of adapters
    "vllm_capacity_lora_running_adapters",  # a count of adapters
}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_name_conventions(spec) -> None:
    assert re.fullmatch(r"vllm_capacity_[a-z0-9_]+", spec.name), "prefix, snake_case, no colons"
    assert spec.name.endswith("_total") == (spec.kind == "counter"), "_total exactly on counters"
    assert spec.name.endswith("_info") == (spec.kind == "info"), "_info exactly on info metrics"
    assert spec.name.endswith(UNIT_SUFFIXES) or spec.name in UNITLESS, "base-unit suffix"
    assert not re.search(r"_(percent|perc|ms|milliseconds|kb|mb|gb|kib|mib|gib)(_|$)", spec.name)
    assert len(spec.help) > 30 and spec.help.endswith("."), "HELP says where the value comes from"
    assert not {"type", "cluster", "env", "job", "instance"} & set(spec.all_labels)


def test_names_unique() -> None:
    names = [s.name for s in SPECS]
    assert len(names) == len(set(names))


def test_documented_metrics_table_matches_catalogue() -> None:
    readme = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(vllm_capacity_[a-z0-9_]+)`", readme, re.MULTILINE))
    assert documented == {s.name for s in SPECS}
    for spec in SPECS:
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{spec.name}`"))
        for label in spec.all_labels:
            assert f"`{label}`" in row, f"docs/metrics.md row of {spec.name} lacks label {label}"


def test_documented_failure_reasons_match_the_code() -> None:
    """Every `reason` label value the agent can export is documented, and nothing else is."""
    text = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    section = text[text.index("## Failure handling") :]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", section, re.MULTILINE)
    assert sorted(documented) == sorted(r.value for r in Reason)


def _shipped_queries(root: Path) -> dict[str, list[str]]:
    """Every PromQL expression the project ships, by where: the dashboards' targets, variables and annotations (as
    Prometheus sees them once Grafana substituted its variables), the alerts, the recording rules, KEDA's trigger."""
    out: dict[str, list[str]] = {}
    for name in ("vllm-capacity.json", "vllm-capacity-fleet.json"):
        d = json.loads((root / "dashboards" / name).read_text())
        out[name] = [promql_for_promtool(e) for e in exprs(d) + annotation_exprs(d)]
    for name in ("vllm-capacity-alerts.yaml", "vllm-capacity-rules.yaml"):
        doc = yaml.safe_load((root / "alerts" / name).read_text())
        out[name] = [r["expr"] for g in doc["groups"] for r in g["rules"]]
    keda = yaml.safe_load((root / "deploy" / "kubernetes" / "keda" / "scaledobject.yaml").read_text())
    out["keda"] = [t["metadata"]["query"] for t in keda["spec"]["triggers"]]
    return out


def test_every_series_is_read_by_a_panel_alert_or_rule_or_says_what_it_is_for() -> None:
    """A series nobody reads is noise in every Prometheus that scrapes the sidecar: each is read by a selector of a
    shipped panel, alert or recording rule (the PromQL parsed by a real parser: a mention in a description or a
    legend is not a read), or docs/metrics.md says what it is for; and every recording rule feeds a panel, an alert
    or KEDA's trigger."""
    root = Path(__file__).parents[1]
    queries = _shipped_queries(root)
    docs = (root / "docs" / "metrics.md").read_text()
    section = docs[docs.index("### Series no shipped panel, alert or rule reads") : docs.index("## How the numbers")]
    explained = set(re.findall(r"`(vllm_capacity_[a-z0-9_]+)`", section))
    explained_rules = set(re.findall(r"`([a-z_]+:vllm_capacity_[a-z0-9_]+:[a-z0-9_]+)`", section))
    read = set().union(*(metric_names(q) for qs in queries.values() for q in qs))
    catalogue = {s.name for s in SPECS}
    assert catalogue - read - explained == set()
    assert (catalogue & read) & explained == set(), "explained as unread, yet read"
    rules = yaml.safe_load((root / "alerts" / "vllm-capacity-rules.yaml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"]}
    readers = [q for where, qs in queries.items() if where != "vllm-capacity-rules.yaml" for q in qs]
    by_rules = set().union(*(metric_names(q) for q in queries["vllm-capacity-rules.yaml"]))
    unread = {r for r in recorded if r not in set().union(*(metric_names(q) for q in readers)) and r not in by_rules}
    assert recorded and unread == explained_rules, unread


def test_a_mention_is_not_a_read() -> None:
    """The parser reads selectors only: a name in a string, a legend or a label value is not a read."""
    assert metric_names('label_replace(up{job="vllm_capacity_up"}, "x", "vllm_capacity_build_info", "", "")') == {"up"}
