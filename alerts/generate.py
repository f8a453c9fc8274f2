"""Generate the Prometheus rule files in this folder from one source: the thresholds and rules below.

    .venv/bin/python alerts/generate.py          # rewrite vllm-capacity-alerts.yaml and vllm-capacity-rules.yaml

Every threshold lives in THRESHOLDS; change it here, regenerate, commit both. A test fails when the committed
YAML differs from what this script produces. Alerts say what hurts users (critical pages) or soon will
(warning tickets); each has a runbook entry in runbook.md.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
# The one place the project's address lives is pyproject.toml's [project.urls]: a fork or an internal mirror changes
# it there and regenerates (this script, then deploy/generate.py), and every alert's runbook_url follows.
REPOSITORY = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
RUNBOOK = f"{REPOSITORY}/blob/main/alerts/runbook.md"

THRESHOLDS = {
    "exporter_job": "vllm-capacity",  # the scrape job of the sidecar (a regex is matched: `.*<job>.*`)
    "kv_cache_high_ratio": 0.90,  # KV blocks held by live requests
    "kv_cache_saturated_ratio": 0.95,
    "preemptions_per_second": 0.1,  # sustained rate of requests preempted for lack of KV cache
    "exhaustion_horizon_seconds": 3600,  # predict the cache full within this horizon...
    "exhaustion_lookback": "30m",  # ...from the growth over this window
    "exhaustion_min_ratio": 0.5,  # and only once it is at least this full
    "concurrency_near_ratio": 0.9,  # running / max concurrency at the observed context
    "gpu_memory_free_min_ratio": 0.02,  # free GPU memory below this share of the total
    "ttft_p99_seconds": 2.0,  # p99 time to first token
    "ttft_window": "5m",
    "target_utilization": 0.8,  # replicas_needed: the share of each replica's capacity demand may use
}
T = THRESHOLDS
TARGET = ["namespace", "pod", "instance", "job"]  # what identifies one sidecar once Prometheus scraped it


def _on(labels: list[str]) -> str:
    return ", ".join(labels)


def alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": f"{RUNBOOK}#{name.lower()}",
        },
    }


WHO = "{{ $labels.model_name }} (engine {{ $labels.engine }}) on {{ $labels.namespace }}/{{ $labels.pod }}"
# vLLM's sleep mode frees the KV cache on purpose: the saturation alerts stay quiet while the engine sleeps
AWAKE = " unless on (namespace, pod, instance, job, model_name, engine) (vllm_capacity_engine_asleep == 1)"

ALERTS = [
    alert(
        "VLLMCapacityExporterDown",
        f'up{{job=~".*{T["exporter_job"]}.*"}} == 0',
        "5m",
        "warning",
        "The vllm-capacity sidecar cannot be scraped.",
        "Prometheus cannot scrape {{ $labels.instance }} ({{ $labels.namespace }}/{{ $labels.pod }}): vLLM's "
        "capacity is unobserved there.",
    ),
    alert(
        "VLLMTargetDown",
        "vllm_capacity_up == 0",
        "2m",
        "critical",
        "vLLM does not answer its sidecar.",
        "The sidecar on {{ $labels.namespace }}/{{ $labels.pod }} cannot read vLLM's /metrics: the server is down or "
        "not serving.",
    ),
    alert(
        "VLLMKVCacheHigh",
        f"vllm_capacity_kv_cache_usage_ratio > {T['kv_cache_high_ratio']}{AWAKE}",
        "10m",
        "warning",
        "vLLM's KV cache is nearly full.",
        f"{WHO}: live requests hold {{{{ $value | humanizePercentage }}}} of the KV cache.",
    ),
    alert(
        "VLLMKVCacheSaturated",
        f"(vllm_capacity_kv_cache_usage_ratio > {T['kv_cache_saturated_ratio']})"
        " and on (namespace, pod, instance, job, model_name, engine) ("
        "(vllm_capacity_requests_waiting_for_capacity > 0)"
        f" or (rate(vllm_capacity_preemptions_total[5m]) > 0)){AWAKE}",
        "5m",
        "critical",
        "vLLM's KV cache is full and requests wait or are preempted.",
        f"{WHO}: live requests hold {{{{ $value | humanizePercentage }}}} of the KV cache"
        "{{ with printf `vllm_capacity_kv_cache_capacity_tokens{pod='%s',model_name='%s',engine='%s'}` "
        "$labels.pod $labels.model_name $labels.engine | query }} ({{ . | first | value | printf `%.0f` }}"
        " tokens){{ end }}, and requests wait for capacity or are preempted.",
    ),
    alert(
        "VLLMPreemptionsSustained",
        f"rate(vllm_capacity_preemptions_total[5m]) > {T['preemptions_per_second']}",
        "15m",
        "warning",
        "vLLM keeps preempting requests for lack of KV cache.",
        f"{WHO} preempts {{{{ $value | printf `%.2f` }}}} requests per second: their work is recomputed.",
    ),
    alert(
        "VLLMRequestsQueuedForCapacity",
        # vLLM counts requests that wait for a batch slot at --max-num-seqs as waiting for "capacity" too: those
        # are not the KV cache's (concurrency_limit names max_num_seqs then, when the agent knows the setting)
        "vllm_capacity_requests_waiting_for_capacity > 0"
        " unless on (namespace, pod, instance, job, model_name, engine)"
        ' (vllm_capacity_concurrency_limit{limit="max_num_seqs"} == 1)',
        "10m",
        "warning",
        "Requests keep waiting for KV-cache capacity.",
        f"{WHO} has {{{{ $value | printf `%.0f` }}}} requests waiting for capacity: KV cache, unless vLLM runs at "
        "its --max-num-seqs (vllm_capacity_concurrency_limit says which, given the setting).",
    ),
    # vLLM can stop admitting requests while its cache is mostly free and its /health stays 200 (vllm-project/vllm
    # issue 53130: running + deferred requests reach max_num_seqs; or "waiting for capacity" on an empty cache).
    # Requests wait, and nothing runs (or vLLM, when it is scraped too, generates no tokens), on a cache that is
    # not full: nothing else pages on it, since no capacity alert fires.
    alert(
        "VLLMAdmissionStalled",
        "(vllm_capacity_requests_waiting > 0)"
        f" and on (namespace, pod, instance, job, model_name, engine) (vllm_capacity_kv_cache_usage_ratio"
        f" < {T['kv_cache_high_ratio']})"
        " and on (namespace, pod, model_name, engine) ((vllm_capacity_requests_running == 0)"
        " or on (namespace, pod, model_name, engine)"
        " (sum by (namespace, pod, model_name, engine) (rate(vllm:generation_tokens_total[5m])) == 0))",
        "5m",
        "critical",
        "vLLM stopped admitting requests while its KV cache has room.",
        f"{WHO}: {{{{ $value | printf `%.0f` }}}} requests wait, nothing runs (or no tokens come out), and the KV "
        "cache is not full: vLLM stopped admitting work. Its /health may still answer 200.",
    ),
    alert(
        "VLLMKVCacheExhaustionPredicted",
        f"(predict_linear(vllm_capacity_kv_cache_used_tokens[{T['exhaustion_lookback']}], "
        f"{T['exhaustion_horizon_seconds']}) > vllm_capacity_kv_cache_capacity_tokens)"
        f" and (vllm_capacity_kv_cache_usage_ratio > {T['exhaustion_min_ratio']}){AWAKE}",
        "15m",
        "warning",
        "vLLM's KV cache will fill at the current growth.",
        f"{WHO}: at the growth of the last {T['exhaustion_lookback']} the KV cache fills within "
        f"{T['exhaustion_horizon_seconds'] // 60} minutes.",
    ),
    alert(
        "VLLMConcurrencyNearCapacity",
        f'vllm_capacity_concurrency_utilization_ratio{{basis="observed_context"}} > {T["concurrency_near_ratio"]}'
        f"{AWAKE}",
        "15m",
        "warning",
        "vLLM runs near the concurrency its KV cache allows at the current request size.",
        f"{WHO} runs {{{{ $value | humanizePercentage }}}} of the requests that fit at the observed context length.",
    ),
    alert(
        "VLLMGPUMemoryNearFull",
        f"(vllm_capacity_gpu_memory_free_bytes / vllm_capacity_gpu_memory_total_bytes) < "
        f"{T['gpu_memory_free_min_ratio']}",
        "15m",
        "warning",
        "A GPU of vLLM's is nearly out of memory.",
        "GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.namespace }}/{{ $labels.pod }} has "
        "{{ $value | humanizePercentage }} of its memory free.",
    ),
    alert(
        "VLLMGPUMemoryContention",
        'vllm_capacity_gpu_memory_bytes{component="other_processes"} > on (namespace, pod, instance, job, gpu, uuid) '
        "(vllm_capacity_gpu_memory_total_bytes - vllm_capacity_gpu_memory_budget_bytes)",
        "5m",
        "warning",
        "Another process uses GPU memory inside vLLM's budget.",
        "On GPU {{ $labels.gpu }} of {{ $labels.namespace }}/{{ $labels.pod }} other processes hold "
        "{{ $value | humanize1024 }}B, more than the memory vLLM leaves outside its budget: an OOM risk.",
    ),
    alert(
        "VLLMTTFTSLOBreach",
        f"histogram_quantile(0.99, sum by (namespace, pod, model_name, le) "
        f"(rate(vllm:time_to_first_token_seconds_bucket[{T['ttft_window']}]))) > {T['ttft_p99_seconds']}",
        "10m",
        "critical",
        "vLLM's p99 time to first token is above its objective.",
        "{{ $labels.model_name }} on {{ $labels.namespace }}/{{ $labels.pod }}: p99 time to first token is "
        f"{{{{ $value | humanizeDuration }}}} (objective {T['ttft_p99_seconds']}s).",
    ),
    alert(
        "VLLMCapacityMetricsMissing",
        "(vllm_capacity_up == 1) unless on (namespace, pod, instance, job) "
        "(count by (namespace, pod, instance, job) (vllm_capacity_kv_cache_capacity_tokens))",
        "15m",
        "warning",
        "vLLM answers, but its KV-cache capacity cannot be derived.",
        "The sidecar on {{ $labels.namespace }}/{{ $labels.pod }} reads vLLM but finds no capacity (a vLLM "
        "version it does not understand, or 0.8.x without --vllm-log): see vllm_capacity_vllm_info and its log.",
    ),
]


def record(name: str, expr: str) -> dict:
    return {"record": name, "expr": expr}


M = "namespace, model_name"
RECORDS = [
    record(
        "namespace_model_name:vllm_capacity_kv_cache_capacity_tokens:sum",
        f"sum by ({M}) (vllm_capacity_kv_cache_capacity_tokens)",
    ),
    record(
        "namespace_model_name:vllm_capacity_kv_cache_used_tokens:sum",
        f"sum by ({M}) (vllm_capacity_kv_cache_used_tokens)",
    ),
    record(
        "namespace_model_name:vllm_capacity_kv_cache_free_tokens:sum",
        f"sum by ({M}) (vllm_capacity_kv_cache_free_tokens)",
    ),
    record(
        "namespace_model_name:vllm_capacity_kv_cache_usage:ratio",
        "namespace_model_name:vllm_capacity_kv_cache_used_tokens:sum"
        " / namespace_model_name:vllm_capacity_kv_cache_capacity_tokens:sum",
    ),
    record("namespace_model_name:vllm_capacity_requests_running:sum", f"sum by ({M}) (vllm_capacity_requests_running)"),
    record("namespace_model_name:vllm_capacity_requests_waiting:sum", f"sum by ({M}) (vllm_capacity_requests_waiting)"),
    record(
        "namespace_model_name_basis:vllm_capacity_max_concurrency:sum",
        f"sum by ({M}, basis) (vllm_capacity_max_concurrency)",
    ),
    record(
        "namespace_model_name_basis:vllm_capacity_concurrency_utilization:ratio",
        "namespace_model_name:vllm_capacity_requests_running:sum"
        " / on (namespace, model_name) group_right namespace_model_name_basis:vllm_capacity_max_concurrency:sum",
    ),
    record(
        "namespace_model_name:vllm_capacity_replicas:count",
        f"count by ({M}) (vllm_capacity_kv_cache_capacity_tokens)",
    ),
    # One replica's capacity in requests: per engine the binding bound (the smallest of observed_context and slo,
    # else vLLM's figure at max_model_len while idle), summed over the pod's engines, averaged over the replicas.
    record(
        "namespace_model_name:vllm_capacity_replica_capacity_requests:avg",
        f"avg by ({M}) (sum by ({M}, pod) ("
        f'min by ({M}, pod, engine) (vllm_capacity_max_concurrency{{basis=~"observed_context|slo"}})'
        f' or max by ({M}, pod, engine) (vllm_capacity_max_concurrency{{basis="max_model_len"}})))',
    ),
    # ONE series an autoscaler can use as it is (KEDA's Prometheus scaler, or HPA through prometheus-adapter): the
    # replicas the model needs for its demand (running + waiting) at the target utilization of each replica.
    record(
        "namespace_model_name:vllm_capacity_replicas_needed:ceil",
        f"ceil((sum by ({M}) (vllm_capacity_requests_running) + sum by ({M}) (vllm_capacity_requests_waiting))"
        f" / on ({M}) (namespace_model_name:vllm_capacity_replica_capacity_requests:avg"
        f" * {T['target_utilization']}))",
    ),
    # The prefix cache's hit ratio beside KV usage (a cached prefix nobody uses counts as free KV cache): vLLM's
    # hit and query counters (tokens; V1 >= 0.9.2, before that gpu_prefix_cache_*), else V0's hit-rate gauge.
    record(
        "namespace_model_name:vllm_capacity_prefix_cache_hit:ratio",
        f"sum by ({M}) (rate(vllm:prefix_cache_hits_total[5m]))"
        f" / sum by ({M}) (rate(vllm:prefix_cache_queries_total[5m]))"
        f" or sum by ({M}) (rate(vllm:gpu_prefix_cache_hits_total[5m]))"
        f" / sum by ({M}) (rate(vllm:gpu_prefix_cache_queries_total[5m]))"
        f" or avg by ({M}) (vllm:gpu_prefix_cache_hit_rate)",
    ),
    record(
        "namespace_component:vllm_capacity_gpu_memory_bytes:sum",
        "sum by (namespace, component) (vllm_capacity_gpu_memory_bytes)",
    ),
]


def documents() -> dict[str, dict]:
    return {
        "vllm-capacity-alerts.yaml": {"groups": [{"name": "vllm-capacity", "rules": ALERTS}]},
        "vllm-capacity-rules.yaml": {"groups": [{"name": "vllm-capacity-fleet", "interval": "30s", "rules": RECORDS}]},
    }


HEADER = "# Generated by alerts/generate.py from its THRESHOLDS and rules: edit that file, then regenerate.\n"


def render() -> dict[str, str]:
    return {
        name: HEADER + yaml.safe_dump(doc, sort_keys=False, width=120, allow_unicode=True)
        for name, doc in documents().items()
    }


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / name).write_text(text)
        print("wrote", HERE / name, file=sys.stderr)
