"""Generate the Grafana dashboards in this folder with grafana-foundation-sdk (pinned in pyproject.toml).

    .venv/bin/python dashboards/generate.py      # rewrite vllm-capacity.json and vllm-capacity-fleet.json

A test fails when the committed JSON differs from what this script produces, when a panel lacks a unit or
thresholds, or when a query names a metric that neither the agent, the recording rules nor vLLM defines.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

from grafana_foundation_sdk.builders import bargauge, prometheus, stat, timeseries, xychart
from grafana_foundation_sdk.builders.common import ReduceDataOptions, StackingConfig, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BigValueTextMode, LegendDisplayMode, LegendPlacement, StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
)
from grafana_foundation_sdk.models.xychart import SeriesMapping, XYShowMode

HERE = Path(__file__).resolve().parent


def _alerts_generator() -> ModuleType:
    """alerts/generate.py: its Config (the cluster label, the forecast panel's horizon: what
    VLLMKVCacheExhaustionPredicted evaluates) is the dashboards' too."""
    if "alerts_generate" in sys.modules:  # loaded already (by deploy/generate.py, or the tests): the same module
        return sys.modules["alerts_generate"]
    spec = importlib.util.spec_from_file_location("alerts_generate", HERE.parent / "alerts" / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


ALERTS = _alerts_generator()
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"


def selectors(c) -> tuple[str, str, str]:
    """The label matchers of one pod's series, of one pod's and model's, and of a model's across the fleet."""
    pod = f'{c.cluster_label}=~"$cluster",namespace=~"$namespace",pod=~"$pod"'
    return (
        pod,
        pod + ',model_name=~"$model"',
        f'{c.cluster_label}=~"$cluster",namespace=~"$namespace",model_name=~"$model"',
    )


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
        p = p.override_by_regexp(
            name, [DynamicConfigValue("unit", second_unit), DynamicConfigValue("custom.axisPlacement", "right")]
        )
    return _with_targets(p, targets)


def _with_targets(panel, targets):
    """Attach the queries with reference ids A, B, C..., which Grafana needs to tell them apart."""
    for i, t in enumerate(targets):
        panel = panel.with_target(t.ref_id(chr(ord("A") + i)))
    return panel


def sorted_by_running(expr: str, width: int = 6) -> str:
    """``expr`` with its ``running`` label also zero-padded into ``bin``: Prometheus returns series sorted by their
    labels as text (1, 12, 2, ...), and ``bin`` sorts before ``running``, so the bars come in numeric order
    (000001, 000002, 000012). label_replace writes only where its regex matches the whole value: one per length."""
    for digits in range(1, width):
        expr = f'label_replace({expr}, "bin", "{"0" * (width - digits)}$1", "running", "([0-9]{{{digits}}})")'
    return expr


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


def variables(d: Dashboard, c, *, pod: bool) -> Dashboard:
    cl = f'{c.cluster_label}=~"$cluster"'
    d = d.with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
    # hidden unless the config says there are several clusters (render() sets `hide` from show_multi_cluster); with
    # one cluster and no cluster label its only value is All (.*), which matches the missing label
    d = d.with_variable(
        QueryVariable("cluster")
        .label("Cluster")
        .datasource(DS)
        .query(f"label_values(vllm_capacity_up, {c.cluster_label})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .multi(True)
        .all_value(".*")
    )
    d = d.with_variable(
        QueryVariable("namespace")
        .label("Namespace")
        .datasource(DS)
        .query(f"label_values(vllm_capacity_up{{{cl}}}, namespace)")
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
            .query(f'label_values(vllm_capacity_up{{{cl},namespace=~"$namespace"}}, pod)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .multi(True)
            .all_value(".*")
        )
    return d.with_variable(
        QueryVariable("model")
        .label("Model")
        .datasource(DS)
        .query(f'label_values(vllm_capacity_kv_cache_capacity_tokens{{{cl},namespace=~"$namespace"}}, model_name)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .multi(True)
        .all_value(".*")
    )


def ttft(q: str, sel: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{{sel}}}[{RATE}])))"


def itl(q: str, sel: str) -> str:
    # vLLM renamed the histogram in 0.10.2 (vllm_capacity_vllm_info{itl_metric} says which one a server has)
    return (
        f"histogram_quantile({q}, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{{{sel}}}[{RATE}])) "
        f"or sum by (le) (rate(vllm:time_per_output_token_seconds_bucket{{{sel}}}[{RATE}])))"
    )


BUDGET_LEGEND = "vLLM budget (gpu_memory_utilization)"


def budget_parts(c) -> list[tuple[str, str]]:
    """The seed's picture of one GPU (legend, PromQL), from whichever sources there are: each part NVML's component
    (vllm_capacity_gpu_memory_bytes) where the sidecar reads NVML, else vLLM's own per-rank figure from its startup
    log; a part neither knows is absent, never 0. Averaged over the pod's GPUs (its ranks are alike), so that the
    parts of one pod add up to one GPU's memory. NVML's vllm_runtime holds the CUDA graphs and the activations: the
    log's figures are taken out of it, the rest (CUDA context, non-torch memory) drawn on its own."""
    pod_sel, sel, _ = selectors(c)

    def nvml(component: str) -> str:
        return f'avg(vllm_capacity_gpu_memory_bytes{{{pod_sel},component="{component}"}})'

    graphs, activations = (
        f"avg(vllm_capacity_cuda_graph_bytes{{{sel}}})",
        f"avg(vllm_capacity_activation_peak_bytes{{{sel}}})",
    )
    return [
        ("weights", f"{nvml('weights')} or avg(vllm_capacity_model_weights_bytes{{{sel}}})"),
        ("CUDA graphs", graphs),
        ("activations (peak)", activations),
        ("KV cache", f"{nvml('kv_cache')} or avg(vllm_capacity_kv_cache_pool_bytes{{{sel}}})"),
        (
            "CUDA context and other runtime",
            f"clamp_min({nvml('vllm_runtime')} - ({graphs} or vector(0)) - ({activations} or vector(0)), 0)",
        ),
        ("other processes", nvml("other_processes")),
        ("driver-reserved", nvml("system")),
        ("free", nvml("free")),
    ]


def budget_line(panel: timeseries.Panel, names: str) -> timeseries.Panel:
    """A stacked panel whose series ``names`` (a regex of their legends) are lines beside the stack, not layers on
    top of it: unstacked, dashed, unfilled."""
    return panel.override_by_regexp(
        names,
        [
            DynamicConfigValue("custom.stacking", {"mode": "none"}),
            DynamicConfigValue("custom.fillOpacity", 0),
            DynamicConfigValue("custom.lineWidth", 2),
            DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
        ],
    )


RUNNING, TOKENS_S, REQUESTS_S, ITL_P99, KNEE = (
    "running requests",
    "output tokens/s",
    "requests/s",
    "p99 ITL",
    "SLO knee (running requests)",
)


def saturation_curve(sel: str) -> xychart.Panel:
    """The seed's saturation curve as one view: throughput (output tokens and finished requests a second) and p99
    inter-token latency against running requests, a point per moment of the time range (the queries joined by
    time), and the SLO knee (the sidecar's max_concurrency{basis=slo}) marked on the throughput curve."""
    targets = (
        query(f"sum(vllm_capacity_requests_running{{{sel}}})", RUNNING),
        query(f"sum(rate(vllm:generation_tokens_total{{{sel}}}[{RATE}]))", TOKENS_S),
        query(f"sum(rate(vllm:request_success_total{{{sel}}}[{RATE}]))", REQUESTS_S),
        query(itl("0.99", sel), ITL_P99),
        query(f'max(vllm_capacity_max_concurrency{{{sel},basis="slo"}})', KNEE),
    )

    def by_name(name: str) -> xychart.MatcherConfig:
        return xychart.MatcherConfig().id("byName").options(name)

    def curve(name: str, x: str, y: str) -> xychart.XYSeriesConfig:
        return (
            xychart.XYSeriesConfig()
            .name(xychart.XychartXYSeriesConfigName().fixed(name))
            .frame(xychart.XychartXYSeriesConfigFrame().matcher(xychart.MatcherConfig().id("byIndex").options(0)))
            .x(xychart.XychartXYSeriesConfigX().matcher(by_name(x)))
            .y(xychart.XychartXYSeriesConfigY().matcher(by_name(y)))
        )

    p = (
        xychart.Panel()
        .title("Saturation curve: throughput and latency against running requests")
        .datasource(DS)
        .unit("short")
        .thresholds(NEUTRAL)
        .span(12)
        .height(8)
        .show(XYShowMode.POINTS)
        .mapping(SeriesMapping.MANUAL)
        .legend(
            VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
        )
        .series(
            [
                curve(TOKENS_S, RUNNING, TOKENS_S),
                curve(REQUESTS_S, RUNNING, REQUESTS_S),
                curve(ITL_P99, RUNNING, ITL_P99),
                curve(KNEE, KNEE, TOKENS_S),
            ]
        )
        .with_transformation(DataTransformerConfig(id_val="joinByField", options={"byField": "Time", "mode": "outer"}))
        .override_by_name(TOKENS_S, [DynamicConfigValue("unit", "suffix: tokens/s")])
        .override_by_name(REQUESTS_S, [DynamicConfigValue("unit", "reqps")])
        .override_by_name(
            ITL_P99, [DynamicConfigValue("unit", "s"), DynamicConfigValue("custom.axisPlacement", "right")]
        )
        .description(
            "The seed's saturation curve, live: a point per moment of the time range at the running requests "
            "then. Throughput (output tokens and finished requests a second, from vLLM's own counters) rises "
            "with concurrency and flattens at saturation; p99 inter-token latency (right axis) stays flat, then "
            "climbs. The SLO knee (the sidecar's SLO-bound concurrency, --slo-itl/--slo-ttft) is marked on the "
            "throughput curve: the most concurrency at which the objective held."
        )
    )
    return _with_targets(p, targets)


def capacity_dashboard(c) -> Dashboard:
    pod_sel, sel, _ = selectors(c)
    horizon = c.exhaustion_horizon_seconds
    d = (
        Dashboard("vLLM Capacity")
        .time("now-3h", "now")
        .description(
            "KV-cache capacity, concurrency and GPU memory of one vLLM pod or model, "
            "from the vllm-capacity sidecar and vLLM's own metrics."
        )
    )
    d = variables(d, c, pod=True)
    d = (
        d.with_row(Row("Capacity at a glance"))
        .with_panel(
            single(
                "KV cache capacity",
                "short",
                query(f"sum(vllm_capacity_kv_cache_capacity_tokens{{{sel}}})", "tokens"),
                span=5,
            )
        )
        .with_panel(
            single(
                "KV cache used",
                "percentunit",
                query(
                    f"sum(vllm_capacity_kv_cache_used_tokens{{{sel}}})"
                    f" / sum(vllm_capacity_kv_cache_capacity_tokens{{{sel}}})",
                    "used",
                ),
                RATIO,
                span=5,
            )
        )
        .with_panel(
            single(
                "Max concurrency at max_model_len",
                "short",
                query(f'sum(vllm_capacity_max_concurrency{{{sel},basis="max_model_len"}})', "requests"),
                span=5,
            )
        )
        .with_panel(
            single(
                "vLLM up",
                "short",
                query(f"min(vllm_capacity_up{{{pod_sel}}})", "up"),
                thresholds((None, "red"), (1, "green")),
                span=4,
            )
        )
        .with_panel(
            single(
                "vLLM version",
                "short",
                query(f"count by (version, schema) (vllm_capacity_vllm_info{{{sel}}})", "{{version}} ({{schema}})"),
                span=5,
            ).text_mode(BigValueTextMode.NAME)
        )
    )
    d = (
        d.with_row(Row("GPU memory budget: $pod").repeat("pod"))
        .with_panel(
            bars(
                "GPU memory by what holds it",
                "bytes",
                *(query(expr, legend) for legend, expr in budget_parts(c)),
                description="The seed's picture of one GPU of the pod (the row repeats per pod; the mean over its "
                "GPUs, whose ranks are alike): weights, CUDA graphs, activations, KV cache, the rest of vLLM's runtime "
                "(the CUDA context, non-torch memory), other processes, driver-reserved, free, from whichever "
                "sources there are: NVML with vLLM's startup log, or the startup log alone (weights, graphs, "
                "activations and the KV pool; no NVML, no total). With NVML the parts add up to the GPU's memory.",
            )
        )
        .with_panel(
            budget_line(
                series(
                    "GPU memory over time",
                    "bytes",
                    *(query(expr, legend) for legend, expr in budget_parts(c)),
                    query(f"avg(vllm_capacity_gpu_memory_budget_bytes{{{pod_sel}}})", BUDGET_LEGEND),
                    stacked=True,
                ),
                re.escape(BUDGET_LEGEND),
            )
        )
    )
    d = (
        d.with_row(Row("KV cache"))
        .with_panel(
            budget_line(
                series(
                    "KV cache tokens",
                    "short",
                    query(f"sum(vllm_capacity_kv_cache_used_tokens{{{sel}}})", "used"),
                    query(f"sum(vllm_capacity_kv_cache_free_tokens{{{sel}}})", "free"),
                    query(f"sum(vllm_capacity_kv_cache_capacity_tokens{{{sel}}})", "capacity"),
                    query(
                        f"avg(ceil(vllm_capacity_mean_context_tokens{{{sel}}}"
                        f" / vllm_capacity_kv_cache_block_size_tokens{{{sel}}}))",
                        "blocks per running request",
                    ),
                    query(
                        f"max(ceil(vllm_capacity_max_model_len_tokens{{{sel}}}"
                        f" / vllm_capacity_kv_cache_block_size_tokens{{{sel}}}))",
                        "blocks per max_model_len request",
                    ),
                    stacked=True,
                    right_axis=("blocks per .*", "short"),
                ),
                "capacity|blocks per .*",
            )
        )
        .with_panel(
            series(
                "KV cache usage",
                "percentunit",
                query(f"vllm_capacity_kv_cache_usage_ratio{{{sel}}}", "{{pod}}/{{engine}}"),
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
                    f'namespace_model_name:vllm_capacity_prefix_cache_hit:ratio{{{c.cluster_label}=~"$cluster",'
                    'namespace=~"$namespace",model_name=~"$model"}',
                    "{{namespace}}/{{model_name}}",
                ),
                query(
                    "namespace_model_name_source:vllm_capacity_prompt_tokens_cached:ratio"
                    f'{{{c.cluster_label}=~"$cluster",namespace=~"$namespace",model_name=~"$model"}}',
                    "from {{source}} {{model_name}}",
                ),
                mn=0,
                mx=1,
                description="Prompt tokens found in the prefix cache, over 5 m, and by the tier that served them "
                "(device, host, disk, p2p: vLLM >= 0.32). Cached prefix blocks no running request holds count as "
                "free KV cache: vLLM evicts them when it needs the room.",
            )
        )
        .with_panel(
            series(
                "Bytes per token (per GPU rank)",
                "bytes",
                query(f"vllm_capacity_kv_cache_bytes_per_token{{{sel}}}", "{{method}} {{pod}}"),
            )
        )
        .with_panel(
            series(
                f"KV cache exhaustion forecast ({horizon / 3600:g} h ahead)",
                "short",
                query(
                    f"predict_linear(vllm_capacity_kv_cache_used_tokens{{{sel}}}[{c.exhaustion_lookback}], "
                    f"{horizon:g})",
                    f"used in {horizon / 3600:g} h {{{{pod}}}}/{{{{engine}}}}",
                ),
                query(f"vllm_capacity_kv_cache_capacity_tokens{{{sel}}}", "capacity {{pod}}/{{engine}}"),
            )
        )
    )
    d = (
        d.with_row(Row("Concurrency"))
        .with_panel(
            series(
                "Running requests against max concurrency",
                "short",
                query(f"sum(vllm_capacity_requests_running{{{sel}}})", "running"),
                query(f'sum(vllm_capacity_max_concurrency{{{sel},basis="max_model_len"}})', "fits at max_model_len"),
                query(
                    f'sum(vllm_capacity_max_concurrency{{{sel},basis="observed_context"}})',
                    "fits at the observed context",
                ),
            )
        )
        .with_panel(
            series(
                "Concurrency utilization",
                "percentunit",
                query(f"vllm_capacity_concurrency_utilization_ratio{{{sel}}}", "{{basis}} {{pod}}/{{engine}}"),
                th=RATIO,
                mn=0,
            )
        )
        .with_panel(
            series(
                "Headroom: requests it can still take",
                "short",
                query(f"vllm_capacity_headroom_requests{{{sel}}}", "{{pod}}/{{engine}} ({{basis}})"),
                query(f'vllm_capacity_max_concurrency{{{sel},basis="slo"}}', "SLO-bound concurrency {{pod}}"),
                query(
                    f'vllm_capacity_max_concurrency{{{sel},basis="sustained"}}'
                    f" and on (pod, engine) (vllm_capacity_sustained_queue_observed{{{sel}}} == 1)",
                    "sustained under a queue {{pod}}",
                ),
                description="While requests wait for capacity, minus the queue (basis queue); after a preemption, at "
                "most 0 (preemption); otherwise the smallest known max concurrency (at the observed context, what "
                "the latency objective allows, what vLLM sustained under a queue) minus running requests. Beside "
                "it, in requests: the SLO-bound concurrency and the sustained one.",
            )
        )
        .with_panel(
            series(
                "What limits concurrency now",
                "short",
                query(f"vllm_capacity_concurrency_limit{{{sel}}} == 1", "{{limit}} {{pod}}/{{engine}}"),
                query(f"sum(vllm_capacity_requests_waiting_deferred{{{sel}}})", "deferred waiting"),
                mn=0,
                description="kv_cache, max_num_seqs (vLLM's --max-num-seqs), lora_slots (requests for an adapter "
                "wait while vLLM's --max-loras slots hold others), token_budget (the engine's steps are as large as "
                "--max-num-batched-tokens allows), slo (over the latency objective) or none (nothing waits); and the "
                "requests vLLM defers for other reasons (a LoRA adapter without a slot among them).",
            )
        )
        .with_panel(
            series(
                "LoRA adapters and slots",
                "short",
                query(f"vllm_capacity_lora_slots{{{sel}}}", "slots {{pod}}/{{engine}}"),
                query(f"vllm_capacity_lora_running_adapters{{{sel}}}", "running {{pod}}/{{engine}}"),
                mn=0,
                description="With --enable-lora: the adapters one batch can serve (vLLM's --max-loras) and those "
                "with requests in the batch; at the slots, a request for another adapter waits (What limits "
                "concurrency now says lora_slots). Empty without LoRA.",
            )
        )
        .with_panel(
            series(
                "Context per running request",
                "short",
                query(f"vllm_capacity_mean_context_tokens{{{sel}}}", "mean context {{pod}}/{{engine}}"),
                query(f"vllm_capacity_max_model_len_tokens{{{sel}}}", "max_model_len {{pod}}"),
            )
        )
        .with_panel(
            series(
                "Waiting and preempted",
                "short",
                query(f"sum(vllm_capacity_requests_waiting{{{sel}}})", "waiting"),
                query(f"sum(vllm_capacity_requests_waiting_for_capacity{{{sel}}})", "waiting for KV capacity"),
                query(f"sum(rate(vllm_capacity_preemptions_total{{{sel}}}[{RATE}]))", "preemptions/s"),
                right_axis=("preemptions/s", "reqps"),  # a rate, not a count: its own axis
            )
        )
        .with_panel(
            series(
                "Requests shed at a queue cap",
                "reqps",
                query(
                    f"sum by (reason) (rate(vllm_capacity_requests_rejected_total{{{sel}}}[{RATE}]))",
                    "rejected ({{reason}})",
                ),
                description="Requests vLLM's frontend answered 503 at --max-num-queued-reqs or "
                "--max-num-queued-tokens (vllm:admission_rejections_total): demand that never waited, so the "
                "waiting panel does not show it.",
            )
        )
    )
    d = (
        d.with_row(Row("Latency against concurrency"))
        .with_panel(
            series(
                "Time to first token",
                "s",
                query(ttft("0.5", sel), "p50"),
                query(ttft("0.99", sel), "p99"),
                th=thresholds((None, "green"), (2, "red")),
            )
        )
        .with_panel(
            series(
                "Time per output token (inter-token latency)",
                "s",
                query(itl("0.5", sel), "p50"),
                query(itl("0.99", sel), "p99"),
            )
        )
        .with_panel(
            bars(
                "Latency vs running requests (learned)",
                "s",
                query(
                    sorted_by_running(
                        f'max by (running) (vllm_capacity_latency_by_concurrency_seconds{{{sel},latency="itl",'
                        'percentile="p90"})'
                    ),
                    "ITL p90 at {{running}} running",
                ),
                span=12,
                description="The sidecar's curve from vLLM's own histograms: p90 inter-token latency in each "
                "running-requests bin (decayed with --latency-half-life). Where it climbs past the objective "
                "(--slo-itl) is the knee: the SLO-bound concurrency, a request count, in the Headroom panel.",
            )
        )
        .with_panel(saturation_curve(sel))
        .with_panel(
            series(
                "Saturation: p99 TTFT and running requests",
                "s",
                query(ttft("0.99", sel), "p99 TTFT"),
                query(f"sum(vllm_capacity_requests_running{{{sel}}})", "running requests"),
                right_axis=("running requests", "short"),
                span=24,
                description="The seed's concurrency sweep, live: latency stays flat while the KV cache "
                "holds the running requests and climbs once requests queue or are preempted.",
            )
        )
        .with_panel(
            series(
                "Speculative decoding: draft tokens accepted",
                "percentunit",
                query(
                    f"sum by (pod) (rate(vllm:spec_decode_num_accepted_tokens_total{{{sel}}}[{RATE}]))"
                    f" / sum by (pod) (rate(vllm:spec_decode_num_draft_tokens_total{{{sel}}}[{RATE}]))",
                    "{{pod}}",
                ),
                mn=0,
                mx=1,
                description="Only with speculative decoding (vLLM's spec_decode_* counters, V0 and V1): the share "
                "of draft tokens the model accepted. The draft's KV cache shares the pool: each running request "
                "also holds its look-ahead slots.",
            )
        )
        .with_panel(
            series(
                "Speculative decoding: tokens accepted per draft",
                "short",
                query(
                    f"sum by (pod) (rate(vllm:spec_decode_num_accepted_tokens_total{{{sel}}}[{RATE}]))"
                    f" / sum by (pod) (rate(vllm:spec_decode_num_drafts_total{{{sel}}}[{RATE}]))",
                    "{{pod}}",
                ),
                mn=0,
                description="Only with speculative decoding, vLLM 0.8.5 or later: how many of each draft's tokens "
                "the model accepted on average (each step then yields that many more tokens).",
            )
        )
        .with_panel(
            budget_line(
                series(
                    "Why this concurrency: blocks a max_model_len request holds, by layer kind",
                    "short",
                    query(
                        f"sum by (pod, group_kind) (vllm_capacity_kv_cache_blocks_per_request{{{sel}}})",
                        "{{pod}} {{group_kind}}",
                    ),
                    query(f"max by (pod) (vllm_capacity_kv_cache_plan_mismatch{{{sel}}})", "plan mismatch {{pod}}"),
                    stacked=True,
                    span=24,
                    right_axis=("plan mismatch .*", "bool"),
                    description="Only with the sidecar's --model-config: vLLM's KV-cache groups as the planner lays "
                    "them out for the server's own budget. Max concurrency at max_model_len is the blocks divided by "
                    "this stack: a Gemma 3's sliding-window groups or a Qwen3-Next's state groups can hold more "
                    "blocks per request than its few full-attention layers suggest. Plan mismatch (right axis, a "
                    "line) is 1 while vLLM's own capacity differs from the plan by more than a block per group: "
                    "then the stack is the planner's, not vLLM's.",
                ),
                "plan mismatch .*",
            )
        )
    )
    g = pod_sel
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
                query(f"vllm_capacity_source_up{{{pod_sel}}}", "{{source}} {{pod}}"),
                th=thresholds((None, "red"), (1, "green")),
                mn=0,
                mx=1,
                span=8,
            )
        )
        .with_panel(
            series(
                "Source errors",
                "cps",  # failed reads per second, by source and reason
                query(
                    f"sum by (source, reason) (rate(vllm_capacity_source_errors_total{{{pod_sel}}}[{RATE}]))",
                    "{{source}} {{reason}}",
                ),
                span=8,
            )
        )
        .with_panel(
            series(
                "Source read time",
                "s",
                query(f"vllm_capacity_source_duration_seconds{{{pod_sel}}}", "{{source}} {{pod}}"),
                span=8,
            )
        )
    )
    return d


def fleet_dashboard(c) -> Dashboard:
    fleet = selectors(c)[2]
    d = (
        Dashboard("vLLM Capacity — Fleet")
        .time("now-24h", "now")
        .description("Per model across replicas, from the vllm-capacity recording rules.")
    )
    d = variables(d, c, pod=False)
    m = "{{namespace}}/{{model_name}}"
    d = (
        d.with_row(Row("Capacity per model"))
        .with_panel(
            series(
                "KV cache tokens per model",
                "short",
                query(f"namespace_model_name:vllm_capacity_kv_cache_capacity_tokens:sum{{{fleet}}}", f"capacity {m}"),
                query(f"namespace_model_name:vllm_capacity_kv_cache_used_tokens:sum{{{fleet}}}", f"used {m}"),
                query(f"namespace_model_name:vllm_capacity_kv_cache_free_tokens:sum{{{fleet}}}", f"free {m}"),
            )
        )
        .with_panel(
            series(
                "KV cache usage per model",
                "percentunit",
                query(f"namespace_model_name:vllm_capacity_kv_cache_usage:ratio{{{fleet}}}", m),
                th=RATIO,
                mn=0,
                mx=1,
            )
        )
        .with_panel(
            series(
                "Replicas: running and needed",
                "short",
                query(f"namespace_model_name:vllm_capacity_replicas:count{{{fleet}}}", f"running {m}"),
                query(f"namespace_model_name:vllm_capacity_replicas_needed:ceil{{{fleet}}}", f"needed {m}"),
                description="Needed: the demand (running + waiting) over each replica's capacity at 80 % "
                "(the binding bound of observed context and latency objective); what the KEDA example scales on.",
            )
        )
        .with_panel(
            series(
                "Running and waiting requests",
                "short",
                query(f"namespace_model_name:vllm_capacity_requests_running:sum{{{fleet}}}", f"running {m}"),
                query(f"namespace_model_name:vllm_capacity_requests_waiting:sum{{{fleet}}}", f"waiting {m}"),
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
                    f"namespace_model_name_basis:vllm_capacity_max_concurrency:sum{{{fleet}}}", f"{m} at {{{{basis}}}}"
                ),
            )
        )
        .with_panel(
            series(
                "Concurrency utilization",
                "percentunit",
                query(
                    f"namespace_model_name_basis:vllm_capacity_concurrency_utilization:ratio{{{fleet}}}",
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
                f'namespace_component:vllm_capacity_gpu_memory_bytes:sum{{{c.cluster_label}=~"$cluster",'
                'namespace=~"$namespace"}',
                "{{namespace}} {{component}}",
            ),
            stacked=True,
            span=24,
        )
    )
    return d


# What each panel written without one shows and where its numbers come from (grafana's dashboard-linter rule
# panel-title-description-rule): Grafana shows it under the (i) beside the title. Keyed by title (or its start, for
# a title that holds a configured value).
PANEL_NOTES = {
    "KV cache capacity": "Tokens vLLM's KV cache holds, summed over the selected engines: the blocks it allocated "
    "at start x tokens per block (cache_config_info).",
    "KV cache used": "Tokens held by running requests over the capacity: vLLM's kv_cache_usage_perc in tokens.",
    "Max concurrency at max_model_len": "Requests of max_model_len tokens the cache holds at once: capacity / "
    "max_model_len, vLLM's own 'Maximum concurrency' figure at start.",
    "vLLM version": "The vLLM version and the generation of its metric names (v0, v1-legacy, v1, v1-capacity) of "
    "each server selected, from /version and /metrics (vllm_capacity_vllm_info): after an upgrade, whether every "
    "replica runs the new one.",
    "vLLM up": "Whether the sidecar can read vLLM's /metrics now (1 up, 0 down). Down: every series derived from "
    "vLLM is gone, not stale.",
    "GPU memory over time": "The parts of the picture beside it, stacked (one GPU of the pod: the row repeats per "
    "pod), and vLLM's budget (NVML total x gpu_memory_utilization) as a dashed line, not a layer: what grew when "
    "memory ran short, and how much of the budget the KV cache took.",
    "KV cache tokens": "The block pool in tokens, over the selected engines: used and free stacked up to the "
    "capacity line (used = capacity x vLLM's usage; free includes prefix-cached blocks nobody holds); on the right "
    "axis the blocks one request holds, at the mean context of running requests and at max_model_len (tokens / "
    "block_size, rounded up). Capacity over blocks per request is the concurrency the cache allows.",
    "Bytes per token (per GPU rank)": "KV-cache bytes one token takes on one GPU rank: vLLM's KV memory over its "
    "token capacity, or the model's geometry (method says which).",
    "KV cache exhaustion forecast (": "Used tokens extrapolated from their growth over the lookback window, against "
    "the capacity: a line crossing capacity is what VLLMKVCacheExhaustionPredicted warns of.",
    "Running requests against max concurrency": "Requests running now against the concurrency each bound allows "
    "(at max_model_len, at the observed context, under the latency objective, sustained under a queue).",
    "Concurrency utilization": "Running requests over each bound's max concurrency: near 1 the engine runs at what "
    "that bound allows.",
    "Context per running request": "The mean context (prompt + generated tokens) a running request holds, against "
    "max_model_len: the distance between the two is the concurrency the 'at max_model_len' figure undercounts.",
    "Waiting and preempted": "Requests waiting (all, and those waiting for capacity) and requests preempted for "
    "lack of KV cache a second, from vLLM's own counters.",
    "Time to first token": "p50 and p99 time to first token from vLLM's own histogram (its job must be scraped).",
    "Time per output token (inter-token latency)": "p50 and p99 time between generated tokens from vLLM's own "
    "histogram (inter_token_latency_seconds, or time_per_output_token_seconds before vLLM 0.10.2).",
    "GPU utilization": "Share of time a kernel ran on the GPU, and memory-bandwidth utilization, from NVML.",
    "GPU power": "Power draw against the enforced power limit, from NVML: the whole board's, once per GPU (MIG "
    "instances share it).",
    "GPU temperature and SM clock": "GPU temperature and the SM clock against its maximum, from NVML: a clock well "
    "below its maximum under load is throttling.",
    "GPU throttling": "NVML's active clock-event reasons (power cap, thermal, ...), 1 while active: why a GPU runs "
    "slow.",
    "Sources up": "Whether the sidecar's last read of each source (vLLM, its /v1/models, its log, NVML) succeeded.",
    "Source errors": "Failed reads of each source a second, by reason (connect, timeout, parse_error, ...): what "
    "to look at when a source is down.",
    "Source read time": "Seconds the last read of each source took, against the sidecar's --timeout.",
    "KV cache tokens per model": "Capacity, used and free tokens summed over a model's replicas (recording rules).",
    "KV cache usage per model": "Used over capacity tokens across a model's replicas (recording rule).",
    "Running and waiting requests": "Requests running and waiting across a model's replicas (recording rules).",
    "Max concurrency": "Each bound's max concurrency summed over a model's replicas (recording rule), by basis.",
    "GPU memory by component": "GPU memory by budget component, summed per namespace (recording rule).",
}


def _panel_note(title: str) -> str:
    note = PANEL_NOTES.get(title) or next((v for k, v in PANEL_NOTES.items() if title.startswith(k)), None)
    if note is None:
        raise KeyError(f"panel {title!r} has no description: write one with the panel or in PANEL_NOTES")
    return note


def _finish(doc: dict, name: str, c) -> None:
    """What the builders do not set: a description on every panel, the up panel's words, links between the two
    dashboards (by their configured uids), vLLM's restarts as annotations on the pod dashboard, and no editing in
    Grafana's UI (the dashboards are code: an edit there is lost at the next provisioning)."""
    doc["editable"] = False
    for panel in doc["panels"]:
        if panel["type"] != "row" and not panel.get("description"):
            panel["description"] = _panel_note(panel["title"])
        if panel["title"] == "vLLM up":
            panel["fieldConfig"]["defaults"]["mappings"] = [
                {"type": "value", "options": {"0": {"text": "down", "index": 0}, "1": {"text": "up", "index": 1}}}
            ]
    ids = c.grafana_dashboard_ids
    other = "vllm-capacity-fleet.json" if name == "vllm-capacity.json" else "vllm-capacity.json"
    title = "Fleet: capacity per model" if name == "vllm-capacity.json" else "Pod: capacity of one vLLM"
    doc["links"] = [
        {"type": "link", "title": title, "url": f"/d/{ids[other]}", "keepTime": True, "includeVars": True,
         "icon": "dashboard", "asDropdown": False, "targetBlank": False, "tags": [], "tooltip": ""}
    ]  # fmt: skip
    if name == "vllm-capacity.json":
        pod_sel = selectors(c)[0]
        doc["annotations"] = {
            "list": [
                {
                    "name": "vLLM restarts",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "enable": True,
                    "iconColor": "orange",
                    # vLLM's own process metrics (its job): the sidecar's are vllm_capacity_process_*
                    "expr": f"changes(process_start_time_seconds{{{pod_sel}}}[$__interval]) > 0",
                    "titleFormat": "vLLM restarted",
                    "textFormat": "{{pod}}",
                    "step": "1m",
                }
            ]
        }


def dashboards(c=ALERTS.DEFAULT) -> dict[str, dict]:
    """The dashboards by file name, as Grafana's JSON model (plain data). With alerts/generate.py's placeholders()
    for ``c`` they hold the mixin's references instead of values (deploy/generate.py writes the mixin from them)."""
    out = {}
    for name, d in (("vllm-capacity.json", capacity_dashboard(c)), ("vllm-capacity-fleet.json", fleet_dashboard(c))):
        model = d.build()
        for i, panel in enumerate(model.panels, start=1):  # stable ids: links and repeats need them
            panel.id_val = i
        doc = json.loads(json.dumps(model, cls=JSONEncoder))
        # what a deployment names its own way (the mixin's _config): the uid, tags, time zone and refresh
        doc |= {
            "uid": c.grafana_dashboard_ids[name],
            "tags": c.dashboard_tags,
            "timezone": c.dashboard_timezone,
            "refresh": c.dashboard_refresh,
        }
        _finish(doc, name, c)
        for variable in doc["templating"]["list"]:
            if variable["name"] == "cluster":  # 0 shows it, 2 hides it (Grafana's VariableHide)
                variable["hide"] = ALERTS.Ref.choose(c.show_multi_cluster, 0, 2)
        out[name] = doc
    return out


def render() -> dict[str, str]:
    return {name: json.dumps(doc, indent=2, sort_keys=True) + "\n" for name, doc in dashboards().items()}


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / name).write_text(text)
        print("wrote", HERE / name, file=sys.stderr)
