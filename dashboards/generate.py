"""Generate the Grafana dashboards in this folder with grafana-foundation-sdk (pinned in pyproject.toml).

    .venv/bin/python dashboards/generate.py      # rewrite vllm-capacity.json and vllm-capacity-fleet.json

A test fails when the committed JSON differs from what this script produces, when a panel lacks a unit or
thresholds, or when a query names a metric that neither the agent, the recording rules nor vLLM defines.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, StackingConfig
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
)

HERE = Path(__file__).resolve().parent


def _alert_thresholds() -> dict:
    """alerts/generate.py's THRESHOLDS: the forecast panel shows what VLLMKVCacheExhaustionPredicted evaluates."""
    spec = importlib.util.spec_from_file_location("alerts_generate", HERE.parent / "alerts" / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.THRESHOLDS


ALERTS = _alert_thresholds()
HORIZON = ALERTS["exhaustion_horizon_seconds"]
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
POD = 'namespace=~"$namespace",pod=~"$pod"'
SEL = POD + ',model_name=~"$model"'
FLEET = 'namespace=~"$namespace",model_name=~"$model"'
RATE = "$__rate_interval"


def thresholds(*steps: tuple[float | None, str]) -> ThresholdsConfig:
    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([Threshold(value=v, color=c) for v, c in steps])


NEUTRAL = thresholds((None, "green"))
RATIO = thresholds((None, "green"), (0.9, "orange"), (0.95, "red"))


def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend)


def series(
    title: str,
    unit: str,
    *targets: prometheus.Dataquery,
    th: ThresholdsConfig = NEUTRAL,
    span: int = 12,
    description: str = "",
    stacked: bool = False,
    mn: float | None = None,
    mx: float | None = None,
    right_axis: tuple[str, str] | None = None,
) -> timeseries.Panel:
    p = timeseries.Panel().title(title).datasource(DS).unit(unit).thresholds(th).span(span).height(8)
    if description:
        p = p.description(description)
    if stacked:
        p = p.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(60)
    if mn is not None:
        p = p.min(mn)
    if mx is not None:
        p = p.max(mx)
    if right_axis is not None:  # (series name regex, its unit): a second quantity on the right axis
        name, second_unit = right_axis
        p = p.override_by_name(
            name, [DynamicConfigValue("unit", second_unit), DynamicConfigValue("custom.axisPlacement", "right")]
        )
    return _with_targets(p, targets)


def _with_targets(panel, targets):
    """Attach the queries with reference ids A, B, C..., which Grafana needs to tell them apart."""
    for i, t in enumerate(targets):
        panel = panel.with_target(t.ref_id(chr(ord("A") + i)))
    return panel


def bars(
    title: str,
    unit: str,
    *targets: prometheus.Dataquery,
    span: int = 12,
    description: str = "",
    th: ThresholdsConfig = NEUTRAL,
) -> bargauge.Panel:
    p = (
        bargauge.Panel()
        .title(title)
        .datasource(DS)
        .unit(unit)
        .thresholds(th)
        .span(span)
        .height(8)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
    )
    if description:
        p = p.description(description)
    return _with_targets(p, targets)


def single(
    title: str, unit: str, target: prometheus.Dataquery, th: ThresholdsConfig = NEUTRAL, span: int = 6
) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .datasource(DS)
        .unit(unit)
        .thresholds(th)
        .span(span)
        .height(4)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
        .with_target(target.ref_id("A"))
    )


def variables(d: Dashboard, *, pod: bool) -> Dashboard:
    d = d.with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
    d = d.with_variable(
        QueryVariable("namespace")
        .label("Namespace")
        .datasource(DS)
        .query("label_values(vllm_capacity_up, namespace)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .multi(True)
        .all_value(".*")
    )
    if pod:
        d = d.with_variable(
            QueryVariable("pod")
            .label("Pod")
            .datasource(DS)
            .query('label_values(vllm_capacity_up{namespace=~"$namespace"}, pod)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .multi(True)
            .all_value(".*")
        )
    return d.with_variable(
        QueryVariable("model")
        .label("Model")
        .datasource(DS)
        .query('label_values(vllm_capacity_kv_cache_capacity_tokens{namespace=~"$namespace"}, model_name)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .multi(True)
        .all_value(".*")
    )


def ttft(q: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{{SEL}}}[{RATE}])))"


def itl(q: str) -> str:
    # vLLM renamed the histogram in 0.10.2 (vllm_capacity_vllm_info{itl_metric} says which one a server has)
    return (
        f"histogram_quantile({q}, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{{{SEL}}}[{RATE}])) "
        f"or sum by (le) (rate(vllm:time_per_output_token_seconds_bucket{{{SEL}}}[{RATE}])))"
    )


def capacity_dashboard() -> Dashboard:
    d = (
        Dashboard("vLLM Capacity")
        .uid("vllm-capacity")
        .tags(["vllm", "vllm-capacity"])
        .refresh("30s")
        .time("now-3h", "now")
        .description(
            "KV-cache capacity, concurrency and GPU memory of one vLLM pod or model, "
            "from the vllm-capacity sidecar and vLLM's own metrics."
        )
    )
    d = variables(d, pod=True)
    d = (
        d.with_row(Row("Capacity at a glance"))
        .with_panel(
            single(
                "KV cache capacity", "short", query(f"sum(vllm_capacity_kv_cache_capacity_tokens{{{SEL}}})", "tokens")
            )
        )
        .with_panel(
            single(
                "KV cache used",
                "percentunit",
                query(
                    f"sum(vllm_capacity_kv_cache_used_tokens{{{SEL}}})"
                    f" / sum(vllm_capacity_kv_cache_capacity_tokens{{{SEL}}})",
                    "used",
                ),
                RATIO,
            )
        )
        .with_panel(
            single(
                "Max concurrency at max_model_len",
                "short",
                query(f'sum(vllm_capacity_max_concurrency{{{SEL},basis="max_model_len"}})', "requests"),
            )
        )
        .with_panel(
            single(
                "vLLM up",
                "short",
                query(f"min(vllm_capacity_up{{{POD}}})", "up"),
                thresholds((None, "red"), (1, "green")),
            )
        )
    )
    d = (
        d.with_row(Row("GPU memory budget"))
        .with_panel(
            bars(
                "GPU memory by what holds it",
                "bytes",
                query(
                    f"sum by (gpu, component) (vllm_capacity_gpu_memory_bytes{{{POD}}})", "GPU {{gpu}} {{component}}"
                ),
                description="The seed's picture: weights, KV cache, vLLM's runtime (CUDA graphs, activations, "
                "context), other processes, driver-reserved, free. They add up to the GPU's memory.",
            )
        )
        .with_panel(
            series(
                "GPU memory over time",
                "bytes",
                query(f"sum by (component) (vllm_capacity_gpu_memory_bytes{{{POD}}})", "{{component}}"),
                query(f"sum(vllm_capacity_gpu_memory_budget_bytes{{{POD}}})", "vLLM budget (gpu_memory_utilization)"),
                stacked=True,
            )
        )
    )
    d = (
        d.with_row(Row("KV cache"))
        .with_panel(
            series(
                "KV cache tokens",
                "short",
                query(f"vllm_capacity_kv_cache_capacity_tokens{{{SEL}}}", "capacity {{pod}}/{{engine}}"),
                query(f"vllm_capacity_kv_cache_used_tokens{{{SEL}}}", "used {{pod}}/{{engine}}"),
                query(f"vllm_capacity_kv_cache_free_tokens{{{SEL}}}", "free {{pod}}/{{engine}}"),
            )
        )
        .with_panel(
            series(
                "KV cache usage",
                "percentunit",
                query(f"vllm_capacity_kv_cache_usage_ratio{{{SEL}}}", "{{pod}}/{{engine}}"),
                th=RATIO,
                mn=0,
                mx=1,
                description="Blocks held by live requests; prefix-cached blocks nobody uses count as free.",
            )
        )
        .with_panel(
            series(
                "Prefix cache hit ratio",
                "percentunit",
                query(
                    'namespace_model_name:vllm_capacity_prefix_cache_hit:ratio{namespace=~"$namespace",'
                    'model_name=~"$model_name"}',
                    "{{namespace}}/{{model_name}}",
                ),
                mn=0,
                mx=1,
                description="Prompt tokens found in the prefix cache, over 5 m. Cached prefix blocks no running "
                "request holds count as free KV cache: vLLM evicts them when it needs the room.",
            )
        )
        .with_panel(
            series(
                "Bytes per token (per GPU rank)",
                "bytes",
                query(f"vllm_capacity_kv_cache_bytes_per_token{{{SEL}}}", "{{method}} {{pod}}"),
            )
        )
        .with_panel(
            series(
                f"KV cache exhaustion forecast ({HORIZON / 3600:g} h ahead)",
                "short",
                query(
                    f"predict_linear(vllm_capacity_kv_cache_used_tokens{{{SEL}}}[{ALERTS['exhaustion_lookback']}], "
                    f"{HORIZON})",
                    f"used in {HORIZON / 3600:g} h {{{{pod}}}}/{{{{engine}}}}",
                ),
                query(f"vllm_capacity_kv_cache_capacity_tokens{{{SEL}}}", "capacity {{pod}}/{{engine}}"),
            )
        )
    )
    d = (
        d.with_row(Row("Concurrency"))
        .with_panel(
            series(
                "Running requests against max concurrency",
                "short",
                query(f"sum(vllm_capacity_requests_running{{{SEL}}})", "running"),
                query(f'sum(vllm_capacity_max_concurrency{{{SEL},basis="max_model_len"}})', "fits at max_model_len"),
                query(
                    f'sum(vllm_capacity_max_concurrency{{{SEL},basis="observed_context"}})',
                    "fits at the observed context",
                ),
            )
        )
        .with_panel(
            series(
                "Concurrency utilization",
                "percentunit",
                query(f"vllm_capacity_concurrency_utilization_ratio{{{SEL}}}", "{{basis}} {{pod}}/{{engine}}"),
                th=RATIO,
                mn=0,
            )
        )
        .with_panel(
            series(
                "Headroom: requests it can still take",
                "short",
                query(f"vllm_capacity_headroom_requests{{{SEL}}}", "{{pod}}/{{engine}} (bound by {{basis}})"),
                query(f'vllm_capacity_max_concurrency{{{SEL},basis="slo"}}', "SLO-bound concurrency {{pod}}"),
                description="The smallest known max concurrency (at the observed context, or what the latency "
                "objective allows) minus running requests; below 0 the replica is over it.",
            )
        )
        .with_panel(
            series(
                "What limits concurrency now",
                "short",
                query(f"vllm_capacity_concurrency_limit{{{SEL}}} == 1", "{{limit}} {{pod}}/{{engine}}"),
                query(f"sum(vllm_capacity_requests_waiting_deferred{{{SEL}}})", "deferred waiting"),
                mn=0,
                description="kv_cache, max_num_seqs (vLLM's --max-num-seqs), slo (over the latency objective) or "
                "none (nothing waits); and the requests vLLM defers for other reasons.",
            )
        )
        .with_panel(
            series(
                "Context per running request",
                "short",
                query(f"vllm_capacity_mean_context_tokens{{{SEL}}}", "mean context {{pod}}/{{engine}}"),
                query(f"vllm_capacity_max_model_len_tokens{{{SEL}}}", "max_model_len {{pod}}"),
            )
        )
        .with_panel(
            series(
                "Waiting and preempted",
                "short",
                query(f"sum(vllm_capacity_requests_waiting{{{SEL}}})", "waiting"),
                query(f"sum(vllm_capacity_requests_waiting_for_capacity{{{SEL}}})", "waiting for KV capacity"),
                query(f"sum(rate(vllm_capacity_preemptions_total{{{SEL}}}[{RATE}]))", "preemptions/s"),
            )
        )
    )
    d = (
        d.with_row(Row("Latency against concurrency"))
        .with_panel(
            series(
                "Time to first token",
                "s",
                query(ttft("0.5"), "p50"),
                query(ttft("0.99"), "p99"),
                th=thresholds((None, "green"), (2, "red")),
            )
        )
        .with_panel(
            series(
                "Time per output token (inter-token latency)", "s", query(itl("0.5"), "p50"), query(itl("0.99"), "p99")
            )
        )
        .with_panel(
            bars(
                "Latency vs running requests (learned)",
                "s",
                query(
                    f'max by (running) (vllm_capacity_latency_by_concurrency_seconds{{{SEL},latency="itl",'
                    'quantile="0.9"})',
                    "ITL p90 at {{running}} running",
                ),
                query(f'min(vllm_capacity_max_concurrency{{{SEL},basis="slo"}})', "the knee: SLO-bound concurrency"),
                span=24,
                description="The sidecar's curve from vLLM's own histograms: p90 inter-token latency in each "
                "running-requests bin (decayed with --latency-half-life). Where it climbs past the objective "
                "(--slo-itl) is the knee.",
            )
        )
        .with_panel(
            series(
                "Saturation: p99 TTFT and running requests",
                "s",
                query(ttft("0.99"), "p99 TTFT"),
                query(f"sum(vllm_capacity_requests_running{{{SEL}}})", "running requests"),
                right_axis=("running requests", "short"),
                span=24,
                description="The seed's concurrency sweep, live: latency stays flat while the KV cache "
                "holds the running requests and climbs once requests queue or are preempted.",
            )
        )
    )
    g = POD
    d = (
        d.with_row(Row("GPU"))
        .with_panel(
            series(
                "GPU utilization",
                "percentunit",
                query(f"vllm_capacity_gpu_utilization_ratio{{{g}}}", "GPU {{gpu}} compute"),
                query(f"vllm_capacity_gpu_memory_bandwidth_utilization_ratio{{{g}}}", "GPU {{gpu}} memory"),
                mn=0,
                mx=1,
                span=8,
            )
        )
        .with_panel(
            series(
                "GPU power",
                "watt",
                query(f"vllm_capacity_gpu_power_watts{{{g}}}", "GPU {{gpu}}"),
                query(f"vllm_capacity_gpu_power_limit_watts{{{g}}}", "GPU {{gpu}} limit"),
                span=8,
            )
        )
        .with_panel(
            series(
                "GPU temperature and SM clock",
                "celsius",
                query(f"vllm_capacity_gpu_temperature_celsius{{{g}}}", "GPU {{gpu}} temperature"),
                query(f"vllm_capacity_gpu_sm_clock_hertz{{{g}}}", "GPU {{gpu}} SM clock"),
                right_axis=("GPU .* SM clock", "hertz"),
                span=8,
                th=thresholds((None, "green"), (85, "red")),
            )
        )
        .with_panel(
            series(
                "GPU throttling",
                "short",
                query(f"vllm_capacity_gpu_throttled{{{g}}} == 1", "GPU {{gpu}} {{reason}}"),
                span=24,
            )
        )
    )
    d = (
        d.with_row(Row("Sidecar health"))
        .with_panel(
            series(
                "Sources up",
                "short",
                query(f"vllm_capacity_source_up{{{POD}}}", "{{source}} {{pod}}"),
                th=thresholds((None, "red"), (1, "green")),
                mn=0,
                mx=1,
                span=8,
            )
        )
        .with_panel(
            series(
                "Source errors",
                "short",
                query(
                    f"sum by (source, reason) (rate(vllm_capacity_source_errors_total{{{POD}}}[{RATE}]))",
                    "{{source}} {{reason}}",
                ),
                span=8,
            )
        )
        .with_panel(
            series(
                "Source read time",
                "s",
                query(f"vllm_capacity_source_duration_seconds{{{POD}}}", "{{source}} {{pod}}"),
                span=8,
            )
        )
    )
    return d


def fleet_dashboard() -> Dashboard:
    d = (
        Dashboard("vLLM Capacity — Fleet")
        .uid("vllm-capacity-fleet")
        .tags(["vllm", "vllm-capacity"])
        .refresh("1m")
        .time("now-24h", "now")
        .description("Per model across replicas, from the vllm-capacity recording rules.")
    )
    d = variables(d, pod=False)
    m = "{{namespace}}/{{model_name}}"
    d = (
        d.with_row(Row("Capacity per model"))
        .with_panel(
            series(
                "KV cache tokens per model",
                "short",
                query(f"namespace_model_name:vllm_capacity_kv_cache_capacity_tokens:sum{{{FLEET}}}", f"capacity {m}"),
                query(f"namespace_model_name:vllm_capacity_kv_cache_used_tokens:sum{{{FLEET}}}", f"used {m}"),
                query(f"namespace_model_name:vllm_capacity_kv_cache_free_tokens:sum{{{FLEET}}}", f"free {m}"),
            )
        )
        .with_panel(
            series(
                "KV cache usage per model",
                "percentunit",
                query(f"namespace_model_name:vllm_capacity_kv_cache_usage:ratio{{{FLEET}}}", m),
                th=RATIO,
                mn=0,
                mx=1,
            )
        )
        .with_panel(
            series(
                "Replicas: running and needed",
                "short",
                query(f"namespace_model_name:vllm_capacity_replicas:count{{{FLEET}}}", f"running {m}"),
                query(f"namespace_model_name:vllm_capacity_replicas_needed:ceil{{{FLEET}}}", f"needed {m}"),
                description="Needed: the demand (running + waiting) over each replica's capacity at 80 % "
                "(the binding bound of observed context and latency objective); what the KEDA example scales on.",
            )
        )
        .with_panel(
            series(
                "Running and waiting requests",
                "short",
                query(f"namespace_model_name:vllm_capacity_requests_running:sum{{{FLEET}}}", f"running {m}"),
                query(f"namespace_model_name:vllm_capacity_requests_waiting:sum{{{FLEET}}}", f"waiting {m}"),
            )
        )
    )
    d = (
        d.with_row(Row("Concurrency per model"))
        .with_panel(
            series(
                "Max concurrency",
                "short",
                query(
                    f"namespace_model_name_basis:vllm_capacity_max_concurrency:sum{{{FLEET}}}", f"{m} at {{{{basis}}}}"
                ),
            )
        )
        .with_panel(
            series(
                "Concurrency utilization",
                "percentunit",
                query(
                    f"namespace_model_name_basis:vllm_capacity_concurrency_utilization:ratio{{{FLEET}}}",
                    f"{m} at {{{{basis}}}}",
                ),
                th=RATIO,
                mn=0,
            )
        )
    )
    d = d.with_row(Row("GPU memory per namespace")).with_panel(
        series(
            "GPU memory by component",
            "bytes",
            query(
                'namespace_component:vllm_capacity_gpu_memory_bytes:sum{namespace=~"$namespace"}',
                "{{namespace}} {{component}}",
            ),
            stacked=True,
            span=24,
        )
    )
    return d


def render() -> dict[str, str]:
    out = {}
    for name, d in (("vllm-capacity.json", capacity_dashboard()), ("vllm-capacity-fleet.json", fleet_dashboard())):
        model = d.build()
        for i, panel in enumerate(model.panels, start=1):  # stable ids: links and repeats need them
            panel.id_val = i
        out[name] = json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
    return out


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / name).write_text(text)
        print("wrote", HERE / name, file=sys.stderr)
