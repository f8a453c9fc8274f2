"""Helpers to check PromQL written by this project: which metric names an expression uses, and which exist."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import promql_parser

from vllm_capacity.exposition.catalogue import SPECS

VLLM_METRIC_NAMES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metric-names.tsv"


def metric_names(expr: str) -> set[str]:
    """The metric names an expression's selectors read, by a real PromQL parser (promql-parser, the Rust crate
    GreptimeDB and Prometheus-compatible engines use): ``foo{...}``, ``{__name__="foo"}``, inside ranges, subqueries,
    aggregations, binary operators and calls. Raises ValueError for what is not PromQL."""
    names: set[str] = set()
    pending = [promql_parser.parse(expr)]
    while pending:
        node = pending.pop()
        if isinstance(node, promql_parser.MatrixSelector):
            node = node.vector_selector
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            names.update(m.value for m in node.matchers.matchers if m.name == "__name__")
        elif isinstance(node, promql_parser.BinaryExpr):
            pending += [node.lhs, node.rhs]
        elif isinstance(node, promql_parser.Call):
            pending += node.args
        elif isinstance(node, promql_parser.AggregateExpr):
            pending += [node.expr, *([node.param] if node.param is not None else [])]
        elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
            pending.append(node.expr)
    return names


def agent_names() -> set[str]:
    names = set()
    for s in SPECS:
        names.add(s.name)
    return names


def vllm_names() -> set[str]:
    """Every vllm: metric family vLLM has registered (fixtures/vllm/metric-names.tsv), with a histogram's
    _bucket/_sum/_count series."""
    names = set()
    for line in VLLM_METRIC_NAMES.read_text().splitlines():
        if line.startswith("#") or line.startswith("name\t"):
            continue
        name, kind = line.split("\t")[:2]
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def load_generator(folder: str) -> ModuleType:
    """alerts/generate.py or dashboards/generate.py, each under a name of its own."""
    name = f"{folder}_generate"
    if name in sys.modules:  # the generators load each other under these names: one module, one Ref class
        return sys.modules[name]
    path = Path(__file__).resolve().parents[2] / folder / "generate.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


MIXIN = Path(__file__).resolve().parents[2] / "deploy" / "mixin"
# A _config unlike the defaults in every label and selector it holds: another job name, a cluster label, another
# runbook address, the cluster selector shown (tests/test_mixin.py, tests/test_e2e_stack.py)
OTHER_CONFIG = {
    "clusterLabel": "k8s_cluster",
    "exporterSelector": 'job=~"(.*/)?gpu-sidecar"',
    "runbookURL": "https://runbooks.example.com/vllm-capacity",
    "showMultiCluster": True,
}


def render_mixin(config: dict[str, object] | None = None) -> dict[str, dict]:
    """deploy/mixin rendered by jsonnet (the C++ implementation's Python binding) with ``config`` over its _config:
    {"alerts": {"groups": ...}, "rules": {"groups": ...}, "dashboards": {file name: dashboard}}."""
    import json

    return json.loads(_render_mixin_text(json.dumps(config or {}, sort_keys=True)))  # a fresh copy each time


@functools.cache
def _render_mixin_text(config: str) -> str:
    """One jsonnet evaluation per _config and test process (a second of CPU each; several tests render the same)."""
    import _jsonnet

    snippet = (
        "local m = (import 'mixin.libsonnet') + { _config+:: std.parseJson(std.extVar('config')) };"
        " { alerts: m.prometheusAlerts, rules: m.prometheusRules, dashboards: m.grafanaDashboards }"
    )
    return str(_jsonnet.evaluate_snippet("render", snippet, jpathdir=[str(MIXIN)], ext_vars={"config": config}))
