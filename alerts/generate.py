"""Generate the Prometheus rule files in this folder from one source: the thresholds and rules below.

    .venv/bin/python alerts/generate.py          # rewrite vllm-capacity-alerts.yaml and vllm-capacity-rules.yaml

Every threshold and label lives in Config (the monitoring mixin's _config, deploy/mixin/); change it here,
regenerate (this script, then dashboards/generate.py and deploy/generate.py), commit them all. A test fails when
the committed YAML differs from what this script produces. Alerts say what hurts users (critical pages) or soon will
(warning tickets); each has a runbook entry in runbook.md.
"""

from __future__ import annotations

import json
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
# The one place the project's address lives is pyproject.toml's [project.urls]: a fork or an internal mirror changes
# it there and regenerates (this script, then deploy/generate.py), and every alert's runbook_url follows.
REPOSITORY = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
RUNBOOK = f"{REPOSITORY}/blob/main/alerts/runbook.md"


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join({"url": "URL", "ids": "IDs"}.get(w, w.title()) for w in rest)


@dataclass(frozen=True)
class Config:
    """Everything a deployment may want to change: the mixin's ``_config`` (deploy/mixin/), under camelCase names
    (``cluster_label`` is ``clusterLabel`` there). The shipped YAML and JSON are rendered with these defaults."""

    # selects the sidecar's scrape job and nothing else (VLLMCapacityExporterDown, VLLMCapacityTargetMissing): the
    # shipped PodMonitors and compose file name it vllm-capacity, vLLM's own job vllm. A pattern that also matched
    # vLLM's job turned a vLLM outage into "exporter down", whose inhibition then silenced VLLMTargetDown.
    exporter_selector: str = 'job="vllm-capacity"'
    # Prometheus' label for the cluster a series comes from: every rule aggregates and joins by it as well. A series
    # without it (one cluster, no external label) is one cluster, as an empty label is.
    cluster_label: str = "cluster"
    runbook_url: str = RUNBOOK  # each alert links to <runbook_url>#<alert name in lower case>
    show_multi_cluster: bool = False  # the dashboards show their cluster selector (hidden by default)
    kv_cache_high_ratio: float = 0.90  # KV blocks held by live requests
    kv_cache_saturated_ratio: float = 0.95
    preemptions_per_second: float = 0.1  # sustained rate of requests preempted for lack of KV cache
    requests_shed_for: str = "5m"  # requests rejected at vLLM's queue caps this long pages
    exhaustion_horizon_seconds: int = 3600  # predict the cache full within this horizon...
    exhaustion_lookback: str = "30m"  # ...from the growth over this window
    exhaustion_min_ratio: float = 0.5  # and only once it is at least this full
    concurrency_near_ratio: float = 0.9  # running / the concurrency at which the latency objectives held
    gpu_memory_free_min_ratio: float = 0.02  # free GPU memory below this share of the total
    ttft_p99_seconds: float = 2.0  # p99 time to first token
    ttft_window: str = "5m"
    # ...paged only with at least this many first tokens a second over the window: a p99 of a few requests is their
    # slowest one (one slow request on a quiet pod paged)
    ttft_min_requests_per_second: float = 0.1
    # multi-window, multi-burn-rate alerts on a TTFT objective (the SRE workbook's), off by default: a share of first
    # tokens within one of vLLM's bucket bounds (its le label as served: "2.5", "1.0"; vLLM has no 2 s bucket)
    ttft_burn_rate_alerts: bool = False
    ttft_objective_le: str = "2.5"
    ttft_slo_target: float = 0.99  # the share of first tokens within the objective; the error budget is the rest
    target_utilization: float = 0.8  # replicas_needed: the share of each replica's capacity demand may use
    # the dashboards, under kube-prometheus' names: the folder it files them in, their tags, time zone, refresh and
    # uid by file name (links between them follow the uid)
    grafana_dashboard_folder: str = "vLLM"
    dashboard_tags: list[str] = field(default_factory=lambda: ["vllm", "vllm-capacity"])
    dashboard_timezone: str = "browser"  # or "utc", or an IANA zone
    dashboard_refresh: str = "30s"
    grafana_dashboard_ids: dict[str, str] = field(
        default_factory=lambda: {name + ".json": name for name in ("vllm-capacity", "vllm-capacity-fleet")}
    )

    def jsonnet(self) -> dict[str, object]:
        """These values under the mixin's names, for its config.libsonnet."""
        return {_camel(f.name): getattr(self, f.name) for f in fields(self)}


class Ref:
    """A value the mixin fills in (a jsonnet expression such as ``$._config.clusterLabel``), standing in for a Config
    field while the generators write the mixin: formatted into a string (``f"{ref:g}"``) it leaves a marker that
    deploy/generate.py turns into ``std.format``; placed as a value it becomes the expression itself."""

    MARK = "\x01"

    def __init__(self, expr: str) -> None:
        self.expr = expr

    def __format__(self, spec: str) -> str:
        return f"{self.MARK}{self.expr}{self.MARK}{spec or 's'}{self.MARK}"

    def __str__(self) -> str:
        return format(self)

    def __getitem__(self, key: str) -> Ref:
        return Ref(f"{self.expr}[{json.dumps(key)}]")

    def __truediv__(self, other: float) -> Ref:
        return Ref(f"({self.expr}) / {other!r}")

    def __bool__(self) -> bool:
        raise TypeError(f"{self.expr} is known only when the mixin is rendered: use Ref.choose")

    @staticmethod
    def choose(value: object, then: object, otherwise: object) -> object:
        """``then if value else otherwise``, also when value is a Ref (then a jsonnet conditional)."""
        if isinstance(value, Ref):
            return Ref(f"if {value.expr} then {json.dumps(then)} else {json.dumps(otherwise)}")
        return then if value else otherwise


def placeholders() -> Config:
    """A Config whose every field is the mixin's ``$._config.<name>``: what the generators write the mixin with."""
    return Config(**{f.name: Ref(f"$._config.{_camel(f.name)}") for f in fields(Config)})  # type: ignore[arg-type]


DEFAULT = Config()


def alert(c: Config, name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": f"{c.runbook_url}#{name.lower()}",
        },
    }


def alerts(c: Config) -> list[dict]:
    cl = c.cluster_label
    target = f"{cl}, namespace, pod, instance, job"  # what identifies one sidecar once Prometheus scraped it
    engine = f"{target}, model_name, engine"  # one engine of one sidecar
    # vLLM's own series come from another scrape job (another instance and job): joined by pod and engine
    vllm_engine = f"{cl}, namespace, pod, model_name, engine"
    who = "{{ $labels.model_name }} (engine {{ $labels.engine }}) on {{ $labels.namespace }}/{{ $labels.pod }}"
    # vLLM's sleep mode frees the KV cache on purpose: the saturation alerts stay quiet while the engine sleeps
    awake = f" unless on ({engine}) (vllm_capacity_engine_asleep == 1)"
    return [
        alert(
            c,
            "VLLMCapacityExporterDown",
            f"up{{{c.exporter_selector}}} == 0",
            "5m",
            "warning",
            "The vllm-capacity sidecar cannot be scraped.",
            "Prometheus cannot scrape {{ $labels.instance }} ({{ $labels.namespace }}/{{ $labels.pod }}): vLLM's "
            "capacity is unobserved there.",
        ),
        alert(
            c,
            "VLLMCapacityTargetMissing",
            f"absent(up{{{c.exporter_selector}}})",
            "15m",
            "warning",
            "Prometheus scrapes no vllm-capacity sidecar at all.",
            "Prometheus scrapes no sidecar{{ with $labels.job }} of job {{ . }}{{ end }}: the PodMonitors select no "
            "pod (a label, a namespace selector) or the sidecars are gone, and no capacity alert can fire.",
        ),
        alert(
            c,
            "VLLMTargetDown",
            "vllm_capacity_up == 0",
            "2m",
            "critical",
            "vLLM does not answer its sidecar.",
            "The sidecar on {{ $labels.namespace }}/{{ $labels.pod }} cannot read vLLM's /metrics: the server is "
            "down or not serving.",
        ),
        alert(
            c,
            "VLLMKVCacheHigh",
            f"vllm_capacity_kv_cache_usage_ratio > {c.kv_cache_high_ratio:g}{awake}",
            "10m",
            "warning",
            "vLLM's KV cache is nearly full.",
            f"{who}: live requests hold {{{{ $value | humanizePercentage }}}} of the KV cache.",
        ),
        alert(
            c,
            "VLLMKVCacheSaturated",
            f"(vllm_capacity_kv_cache_usage_ratio > {c.kv_cache_saturated_ratio:g})"
            f" and on ({engine}) ("
            "(vllm_capacity_requests_waiting_for_capacity > 0)"
            f" or (rate(vllm_capacity_preemptions_total[5m]) > 0)){awake}",
            "5m",
            "critical",
            "vLLM's KV cache is full and requests wait or are preempted.",
            f"{who}: live requests hold {{{{ $value | humanizePercentage }}}} of the KV cache"
            f"{{{{ with printf `vllm_capacity_kv_cache_capacity_tokens{{{cl}='%s',namespace='%s',pod='%s',"
            f"model_name='%s',engine='%s'}}` $labels.{cl} $labels.namespace $labels.pod $labels.model_name "
            "$labels.engine | query }} ({{ . | first | value | printf `%.0f` }} tokens){{ end }}, and requests "
            "wait for capacity or are preempted.",
        ),
        alert(
            c,
            "VLLMPreemptionsSustained",
            f"rate(vllm_capacity_preemptions_total[5m]) > {c.preemptions_per_second:g}",
            "15m",
            "warning",
            "vLLM keeps preempting requests for lack of KV cache.",
            f"{who} preempts {{{{ $value | printf `%.2f` }}}} requests per second: their work is recomputed.",
        ),
        alert(
            c,
            "VLLMRequestsShed",
            # vLLM's frontend answers 503 at its queue caps (--max-num-queued-reqs, --max-num-queued-tokens): those
            # requests never wait, so no queue or saturation alert sees them (vllm:admission_rejections_total)
            f"sum by ({target}, model_name, reason) (rate(vllm_capacity_requests_rejected_total[5m])) > 0",
            c.requests_shed_for,
            "critical",
            "vLLM turns requests away at a queue cap: users get HTTP 503.",
            "{{ $labels.model_name }} on {{ $labels.namespace }}/{{ $labels.pod }} rejects "
            "{{ $value | printf `%.2f` }} requests per second at its {{ $labels.reason }} cap: demand it never queued.",
        ),
        alert(
            c,
            "VLLMRequestsQueuedForCapacity",
            # vLLM counts requests that wait for a batch slot at --max-num-seqs as waiting for "capacity" too: those
            # are not the KV cache's (concurrency_limit names max_num_seqs then, when the agent knows the setting)
            "vllm_capacity_requests_waiting_for_capacity > 0"
            f" unless on ({engine})"
            ' (vllm_capacity_concurrency_limit{limit="max_num_seqs"} == 1)',
            "10m",
            "warning",
            "Requests keep waiting for KV-cache capacity.",
            f"{who} has {{{{ $value | printf `%.0f` }}}} requests waiting for capacity: KV cache, unless vLLM runs "
            "at its --max-num-seqs (vllm_capacity_concurrency_limit says which, given the setting).",
        ),
        # vLLM can stop admitting requests while its cache is mostly free and its /health stays 200 (vllm-project/
        # vllm issue 53130: running + deferred requests reach max_num_seqs; or "waiting for capacity" on an empty
        # cache). Requests wait, and nothing runs (or vLLM, when it is scraped too, generates no tokens), on a cache
        # that is not full: nothing else pages on it, since no capacity alert fires.
        alert(
            c,
            "VLLMAdmissionStalled",
            "(vllm_capacity_requests_waiting > 0)"
            f" and on ({engine}) (vllm_capacity_kv_cache_usage_ratio < {c.kv_cache_high_ratio:g})"
            f" and on ({vllm_engine}) ((vllm_capacity_requests_running == 0)"
            f" or on ({vllm_engine})"
            f" (sum by ({vllm_engine}) (rate(vllm:generation_tokens_total[5m])) == 0))",
            "5m",
            "critical",
            "vLLM stopped admitting requests while its KV cache has room.",
            f"{who}: {{{{ $value | printf `%.0f` }}}} requests wait, nothing runs (or no tokens come out), and the "
            "KV cache is not full: vLLM stopped admitting work. Its /health may still answer 200.",
        ),
        alert(
            c,
            "VLLMKVCacheExhaustionPredicted",
            f"(predict_linear(vllm_capacity_kv_cache_used_tokens[{c.exhaustion_lookback}], "
            f"{c.exhaustion_horizon_seconds:g}) > vllm_capacity_kv_cache_capacity_tokens)"
            f" and (vllm_capacity_kv_cache_usage_ratio > {c.exhaustion_min_ratio:g}){awake}",
            "15m",
            "warning",
            "vLLM's KV cache will fill at the current growth.",
            f"{who}: at the growth of the last {c.exhaustion_lookback} the KV cache fills within "
            f"{c.exhaustion_horizon_seconds / 60:g} minutes.",
        ),
        # Near the concurrency at which the latency objectives held (--slo-itl, --slo-ttft): a bound the KV alerts
        # cannot see (the cache may be half free). It was the observed-context utilization, which is the KV usage
        # ratio again whenever requests run: it paged twice for one cause.
        alert(
            c,
            "VLLMConcurrencyNearCapacity",
            f'vllm_capacity_concurrency_utilization_ratio{{basis="slo"}} > {c.concurrency_near_ratio:g}{awake}',
            "15m",
            "warning",
            "vLLM runs near the concurrency at which its latency objective holds.",
            f"{who} runs {{{{ $value | humanizePercentage }}}} of the requests at which its latency objectives held "
            '(max_concurrency{basis="slo"}): more load breaks them, whatever the KV cache has free.',
        ),
        alert(
            c,
            "VLLMLoRASlotsExhausted",
            # vLLM defers them (not "waiting for capacity"): no KV alert covers them
            'vllm_capacity_concurrency_limit{limit="lora_slots"} == 1',
            "10m",
            "warning",
            "Requests wait for a LoRA slot that other adapters hold.",
            f"{who}: requests wait while every one of vLLM's --max-loras slots serves another adapter, whatever "
            "the KV cache has free.",
        ),
        alert(
            c,
            "VLLMGPUMemoryNearFull",
            f"(vllm_capacity_gpu_memory_free_bytes / vllm_capacity_gpu_memory_total_bytes) < "
            f"{c.gpu_memory_free_min_ratio:g}",
            "15m",
            "warning",
            "A GPU of vLLM's is nearly out of memory.",
            "GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.namespace }}/{{ $labels.pod }} has "
            "{{ $value | humanizePercentage }} of its memory free.",
        ),
        alert(
            c,
            "VLLMGPUMemoryContention",
            f'vllm_capacity_gpu_memory_bytes{{component="other_processes"}} > on ({target}, gpu, uuid) '
            "(vllm_capacity_gpu_memory_total_bytes - vllm_capacity_gpu_memory_budget_bytes)",
            "5m",
            "warning",
            "Another process uses GPU memory inside vLLM's budget.",
            "On GPU {{ $labels.gpu }} of {{ $labels.namespace }}/{{ $labels.pod }} other processes hold "
            "{{ $value | humanize1024 }}B, more than the memory vLLM leaves outside its budget: an OOM risk.",
        ),
        alert(
            c,
            "VLLMGPUUnreadable",
            "vllm_capacity_gpu_up == 0",
            "5m",
            "warning",
            "NVML cannot read one of vLLM's GPUs.",
            "GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.namespace }}/{{ $labels.pod }} cannot be read "
            "while the others can: lost, needing a reset, or no permission (vllm_capacity_source_errors_total"
            '{source="nvml"} says which).',
        ),
        alert(
            c,
            "VLLMTTFTSLOBreach",
            f"(histogram_quantile(0.99, sum by ({cl}, namespace, pod, model_name, le) "
            f"(rate(vllm:time_to_first_token_seconds_bucket[{c.ttft_window}]))) > {c.ttft_p99_seconds:g}) "
            f"and on ({cl}, namespace, pod, model_name) (sum by ({cl}, namespace, pod, model_name) "
            f'(rate(vllm:time_to_first_token_seconds_bucket{{le="+Inf"}}[{c.ttft_window}])) '
            f">= {c.ttft_min_requests_per_second:g})",
            "10m",
            "critical",
            "vLLM's p99 time to first token is above its objective.",
            "{{ $labels.model_name }} on {{ $labels.namespace }}/{{ $labels.pod }}: p99 time to first token is "
            f"{{{{ $value | humanizeDuration }}}} (objective {c.ttft_p99_seconds:g}s).",
        ),
        alert(
            c,
            "VLLMCapacityMetricsMissing",
            f"(vllm_capacity_up == 1) unless on ({target}) "
            f"(count by ({target}) (vllm_capacity_kv_cache_capacity_tokens))",
            "15m",
            "warning",
            "vLLM answers, but its KV-cache capacity cannot be derived.",
            "The sidecar on {{ $labels.namespace }}/{{ $labels.pod }} reads vLLM but finds no capacity (a vLLM "
            "version it does not understand, or 0.8.x without --vllm-log): see vllm_capacity_vllm_info and its log.",
        ),
    ]


# (alert, long window, short window, burn rate, for, severity): 2 % of a 30-day error budget in an hour pages, 5 % in
# six hours opens a ticket (Google's SRE workbook, "Alerting on SLOs", multiwindow, multi-burn-rate alerts)
BURN_RATES = (
    ("VLLMTTFTErrorBudgetBurnFast", "1h", "5m", 14.4, "2m", "critical"),
    ("VLLMTTFTErrorBudgetBurnSlow", "6h", "30m", 6, "15m", "warning"),
)
SLO_WINDOWS = ("5m", "30m", "1h", "6h")


def slo_errors(window: str) -> str:
    return f"namespace_model_name:vllm_capacity_ttft_slo_errors:ratio_rate{window}"


def slo_first_tokens(window: str) -> str:
    return f"namespace_model_name:vllm_capacity_ttft_first_tokens:rate{window}"


def slo_records(c: Config) -> list[dict]:
    """Per model and window the burn-rate alerts read: first tokens a second (recorded once: the error ratio divides
    by it and the alerts' traffic guard reads it), and the share of them over the objective."""
    m = f"{c.cluster_label}, namespace, model_name"
    bucket = "vllm:time_to_first_token_seconds_bucket"
    first_tokens = [
        record(slo_first_tokens(w), f'sum by ({m}) (rate({bucket}{{le="+Inf"}}[{w}]))') for w in SLO_WINDOWS
    ]
    errors = [
        record(
            slo_errors(w),
            f'1 - (sum by ({m}) (rate({bucket}{{le="{c.ttft_objective_le}"}}[{w}])) / {slo_first_tokens(w)})',
        )
        for w in SLO_WINDOWS
    ]
    return first_tokens + errors


def slo_alerts(c: Config) -> list[dict]:
    """Each burn rate over a long and a short window (the short one ends the alert soon after the burn stops), on a
    model with at least ttftMinRequestsPerSecond first tokens a second over the long window."""
    m = f"{c.cluster_label}, namespace, model_name"
    out = []
    for name, long, short, rate, for_, severity in BURN_RATES:
        budget = f"({rate:g} * (1 - {c.ttft_slo_target:g}))"
        out.append(
            alert(
                c,
                name,
                f"({slo_errors(long)} > {budget}) and on ({m}) ({slo_errors(short)} > {budget}) and on ({m}) "
                f"({slo_first_tokens(long)} >= {c.ttft_min_requests_per_second:g})",
                for_,
                severity,
                f"vLLM's time to first token burns its error budget {rate:g} times as fast as the objective allows.",
                "{{ $labels.model_name }} in {{ $labels.namespace }}: {{ $value | humanizePercentage }} of first "
                f"tokens over the last {long} took longer than {c.ttft_objective_le}s (objective: "
                f"{c.ttft_slo_target:g} within it).",
            )
        )
    return out


def record(name: str, expr: str) -> dict:
    return {"record": name, "expr": expr}


def records(c: Config) -> list[dict]:
    m = f"{c.cluster_label}, namespace, model_name"  # the rules' names say namespace_model_name: per cluster too
    return [
        record(
            "namespace_model_name:vllm_capacity_kv_cache_capacity_tokens:sum",
            f"sum by ({m}) (vllm_capacity_kv_cache_capacity_tokens)",
        ),
        record(
            "namespace_model_name:vllm_capacity_kv_cache_used_tokens:sum",
            f"sum by ({m}) (vllm_capacity_kv_cache_used_tokens)",
        ),
        record(
            "namespace_model_name:vllm_capacity_kv_cache_free_tokens:sum",
            f"sum by ({m}) (vllm_capacity_kv_cache_free_tokens)",
        ),
        record(
            "namespace_model_name:vllm_capacity_kv_cache_usage:ratio",
            "namespace_model_name:vllm_capacity_kv_cache_used_tokens:sum"
            " / namespace_model_name:vllm_capacity_kv_cache_capacity_tokens:sum",
        ),
        record(
            "namespace_model_name:vllm_capacity_requests_running:sum", f"sum by ({m}) (vllm_capacity_requests_running)"
        ),
        record(
            "namespace_model_name:vllm_capacity_requests_waiting:sum", f"sum by ({m}) (vllm_capacity_requests_waiting)"
        ),
        record(
            "namespace_model_name_basis:vllm_capacity_max_concurrency:sum",
            f"sum by ({m}, basis) (vllm_capacity_max_concurrency)",
        ),
        record(
            "namespace_model_name_basis:vllm_capacity_concurrency_utilization:ratio",
            "namespace_model_name:vllm_capacity_requests_running:sum"
            f" / on ({m}) group_right namespace_model_name_basis:vllm_capacity_max_concurrency:sum",
        ),
        record(
            "namespace_model_name:vllm_capacity_replicas:count",
            f"count by ({m}) (vllm_capacity_kv_cache_capacity_tokens)",
        ),
        # One replica's capacity in requests: per engine the binding bound (the smallest of observed_context, slo and
        # sustained once a queue was seen: what vLLM holds under pressure), else vLLM's figure at max_model_len
        # while idle; summed over the pod's engines, averaged over the replicas.
        record(
            "namespace_model_name:vllm_capacity_replica_capacity_requests:avg",
            f"avg by ({m}) (sum by ({m}, pod) ("
            f"min by ({m}, pod, engine) ("
            'vllm_capacity_max_concurrency{basis=~"observed_context|slo"}'
            ' or (vllm_capacity_max_concurrency{basis="sustained"}'
            f" and on ({c.cluster_label}, namespace, pod, model_name, engine)"
            " (vllm_capacity_sustained_queue_observed == 1)))"
            f' or max by ({m}, pod, engine) (vllm_capacity_max_concurrency{{basis="max_model_len"}})))',
        ),
        # ONE series an autoscaler can use as it is (KEDA's Prometheus scaler, or HPA through prometheus-adapter):
        # the replicas the model needs for its demand (running + waiting: a queue is demand no replica meets; plus
        # the demand shed at the queue caps, where it is known) at
        # the target utilization of what each replica holds; at least 1 while the model is served. None while a
        # replica's capacity is not above 0: a demand over 0 was +Inf replicas (an autoscaler's maximum), none over
        # 0 NaN; without the series an autoscaler holds what it has (KEDA with ignoreNullValues "false").
        # Demand shed at vLLM's queue caps (HTTP 503, never waiting) as the concurrency it would have held: the
        # rejections a second x the mean time a request takes (Little's law, from vLLM's own e2e latency histogram,
        # scraped from vLLM itself); absent where vLLM sheds nothing or is not scraped
        record(
            "namespace_model_name:vllm_capacity_requests_shed_concurrency:rate",
            f"sum by ({m}) (rate(vllm_capacity_requests_rejected_total[5m]))"
            f" * on ({m}) (sum by ({m}) (rate(vllm:e2e_request_latency_seconds_sum[5m]))"
            f" / sum by ({m}) (rate(vllm:e2e_request_latency_seconds_count[5m])))",
        ),
        record(
            "namespace_model_name:vllm_capacity_replicas_needed:ceil",
            f"clamp_min(ceil(((sum by ({m}) (vllm_capacity_requests_running)"
            f" + sum by ({m}) (vllm_capacity_requests_waiting))"
            f" + on ({m}) namespace_model_name:vllm_capacity_requests_shed_concurrency:rate"
            f" or (sum by ({m}) (vllm_capacity_requests_running) + sum by ({m}) (vllm_capacity_requests_waiting)))"
            f" / on ({m}) (namespace_model_name:vllm_capacity_replica_capacity_requests:avg"
            f" * {c.target_utilization:g} > 0)), 1)",
        ),
        # The prefix cache's hit ratio beside KV usage (a cached prefix nobody uses counts as free KV cache): vLLM's
        # hit and query counters (tokens; V1 >= 0.9.2, before that gpu_prefix_cache_*), else V0's hit-rate gauge.
        record(
            "namespace_model_name:vllm_capacity_prefix_cache_hit:ratio",
            f"sum by ({m}) (rate(vllm:prefix_cache_hits_total[5m]))"
            f" / sum by ({m}) (rate(vllm:prefix_cache_queries_total[5m]))"
            f" or sum by ({m}) (rate(vllm:gpu_prefix_cache_hits_total[5m]))"
            f" / sum by ({m}) (rate(vllm:gpu_prefix_cache_queries_total[5m]))"
            f" or avg by ({m}) (vllm:gpu_prefix_cache_hit_rate)",
        ),
        # Which tier served the prompt tokens the prefix cache found (vLLM >= 0.32's
        # vllm:prompt_tokens_cached_by_source_total: device, host, disk, p2p, external_unspecified), over every
        # prompt token: the CPU tier's worth in hits
        record(
            "namespace_model_name_source:vllm_capacity_prompt_tokens_cached:ratio",
            f"sum by ({m}, source) (rate(vllm:prompt_tokens_cached_by_source_total[5m]))"
            f" / on ({m}) group_left sum by ({m}) (rate(vllm:prompt_tokens_total[5m]))",
        ),
        # Speculative decoding (only when vLLM runs it): the share of draft tokens the target model accepted, over
        # 5 m; vLLM's counters have these names in V0 (0.5.5-0.9.2) and V1 (0.8.4+).
        record(
            "namespace_model_name:vllm_capacity_spec_decode_acceptance:ratio",
            f"sum by ({m}) (rate(vllm:spec_decode_num_accepted_tokens_total[5m]))"
            f" / sum by ({m}) (rate(vllm:spec_decode_num_draft_tokens_total[5m]))",
        ),
        record(
            "namespace_component:vllm_capacity_gpu_memory_bytes:sum",
            f"sum by ({c.cluster_label}, namespace, component) (vllm_capacity_gpu_memory_bytes)",
        ),
    ]


ALERT_GROUP, RECORD_GROUP = "vllm-capacity", "vllm-capacity-fleet"
RECORD_INTERVAL = "30s"


SLO_ALERT_GROUP, SLO_RECORD_GROUP = "vllm-capacity-slo", "vllm-capacity-slo-rules"


def slo_groups(c: Config) -> tuple[dict, dict]:
    """The burn-rate alerts' group and their recording rules' group (with ttftBurnRateAlerts)."""
    return (
        {"name": SLO_ALERT_GROUP, "rules": slo_alerts(c)},
        {"name": SLO_RECORD_GROUP, "interval": RECORD_INTERVAL, "rules": slo_records(c)},
    )


def documents(c: Config = DEFAULT, *, slo: bool | None = None) -> dict[str, dict]:
    """The rule files, by name: {"groups": [...]} as Prometheus reads them; with ``slo`` (by default
    ``c.ttft_burn_rate_alerts``) also the burn-rate groups, each after the group of its kind."""
    alert_groups = [{"name": ALERT_GROUP, "rules": alerts(c)}]
    record_groups = [{"name": RECORD_GROUP, "interval": RECORD_INTERVAL, "rules": records(c)}]
    if c.ttft_burn_rate_alerts if slo is None else slo:
        slo_alert_group, slo_record_group = slo_groups(c)
        alert_groups.append(slo_alert_group)
        record_groups.append(slo_record_group)
    return {
        "vllm-capacity-alerts.yaml": {"groups": alert_groups},
        "vllm-capacity-rules.yaml": {"groups": record_groups},
    }


HEADER = "# Generated by alerts/generate.py from its Config and rules: edit that file, then regenerate.\n"


def render() -> dict[str, str]:
    return {
        name: HEADER + yaml.safe_dump(doc, sort_keys=False, width=120, allow_unicode=True)
        for name, doc in documents().items()
    }


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / name).write_text(text)
        print("wrote", HERE / name, file=sys.stderr)
