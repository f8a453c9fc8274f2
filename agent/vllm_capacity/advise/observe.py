"""What ``advise`` reads of a window from Prometheus: one PromQL query per figure, each over every deployment at
once (by cluster, namespace and model_name, as the shipped recording rules group them), split into one
:class:`~vllm_capacity.levers.traffic.Observed` per deployment. The queries are printed with the figures, so each
can be re-run as it was."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from vllm_capacity.levers.window import Figure, Observed
from vllm_capacity.sources.prometheus import PrometheusClient, PrometheusError, Sample

GROUP = ("cluster", "namespace", "model_name")
BY = ", ".join(GROUP)
#: the subqueries' resolution: the peak of a sum over pods, the span of the data
RESOLUTION = "5m"
#: the least data a window must hold for advice
MIN_DATA_SECONDS = 3600.0

#: figure -> PromQL: $by the grouping labels, $sel the selector's matchers (after a comma), $w the window, $res the
#: subqueries' resolution
QUERIES: dict[str, str] = {
    "replicas": "count by ($by) (group by ($by, pod, instance) "
    "(last_over_time(vllm_capacity_kv_cache_capacity_tokens{$sel}[15m])))",
    "data_seconds": "max by ($by) (max_over_time(timestamp(vllm_capacity_kv_cache_capacity_tokens{$sel})[$w:$res])) "
    "- min by ($by) (min_over_time(timestamp(vllm_capacity_kv_cache_capacity_tokens{$sel})[$w:$res]))",
    "capacity_tokens": "max by ($by) (last_over_time(vllm_capacity_kv_cache_capacity_tokens{$sel}[$w]))",
    "max_model_len": "max by ($by) (last_over_time(vllm_capacity_max_model_len_tokens{$sel}[$w]))",
    "pool_bytes": "max by ($by) (last_over_time(vllm_capacity_kv_cache_pool_bytes{$sel}[$w]))",
    "weights_bytes": "max by ($by) (last_over_time(vllm_capacity_model_weights_bytes{$sel}[$w]))",
    "prompt_p999": "histogram_quantile(0.999, sum by ($by, le) "
    "(increase(vllm:request_prompt_tokens_bucket{$sel}[$w])))",
    "output_p999": "histogram_quantile(0.999, sum by ($by, le) "
    "(increase(vllm:request_generation_tokens_bucket{$sel}[$w])))",
    "requests": "sum by ($by) (increase(vllm:request_prompt_tokens_count{$sel}[$w]))",
    "preemptions": "sum by ($by) (increase(vllm_capacity_preemptions_total{$sel}[$w]))",
    "shed": "sum by ($by) (increase(vllm_capacity_requests_rejected_total{$sel}[$w]))",
    "kv_usage_max": "max by ($by) (max_over_time(vllm_capacity_kv_cache_usage_ratio{$sel}[$w]))",
    "used_tokens_max": "max by ($by) (max_over_time(vllm_capacity_kv_cache_used_tokens{$sel}[$w]))",
    "waiting_for_capacity_max": "max_over_time(sum by ($by) "
    "(vllm_capacity_requests_waiting_for_capacity{$sel})[$w:$res])",
    "limit_max_num_seqs": 'avg by ($by) (avg_over_time(vllm_capacity_concurrency_limit{limit="max_num_seqs"$sel}[$w]))',
    "limit_token_budget": 'avg by ($by) (avg_over_time(vllm_capacity_concurrency_limit{limit="token_budget"$sel}[$w]))',
    "running_max": "max by ($by) (max_over_time(vllm_capacity_requests_running{$sel}[$w]))",
    "peak_demand": "max_over_time((sum by ($by) (vllm_capacity_requests_running{$sel}) + sum by ($by) "
    "(vllm_capacity_requests_waiting{$sel}))[$w:$res])",
    "slo_knee": 'min by ($by) (last_over_time(vllm_capacity_max_concurrency{basis="slo"$sel}[$w]))',
    "slo_knee_observed": "max by ($by) (last_over_time(vllm_capacity_slo_knee_observed{$sel}[$w]))",
    "per_replica_p90": 'min by ($by) (last_over_time(vllm_capacity_max_concurrency{basis="p90_context"$sel}[$w]))',
    # the GPU series carry no model_name: joined by pod to the engine's vllm_info
    "gpu_total_bytes": "max by ($by) (last_over_time(vllm_capacity_gpu_memory_total_bytes{$sel}[$w]) "
    "* on (cluster, namespace, pod) group_left (model_name) group by (cluster, namespace, pod, model_name) "
    "(last_over_time(vllm_capacity_vllm_info{$sel}[$w])))",
    "gpu_free_min_bytes": 'min by ($by) (min_over_time(vllm_capacity_gpu_memory_bytes{component="free"$sel}[$w]) '
    "* on (cluster, namespace, pod) group_left (model_name) group by (cluster, namespace, pod, model_name) "
    "(last_over_time(vllm_capacity_vllm_info{$sel}[$w])))",
}
INFO = (
    "max by ($by, version, cache_dtype, block_size, gpu_memory_utilization) "
    "(last_over_time(vllm_capacity_vllm_info{$sel}[$w]))"
)
#: the histograms whose largest finite bucket bounds what their p99.9 can say (vLLM's build_1_2_5_buckets(
#: max_model_len), or --custom-histogram-buckets from 0.32)
TOP_BUCKETS = {
    "prompt_top_bucket": "group by ($by, le) (last_over_time(vllm:request_prompt_tokens_bucket{$sel}[$w]))",
    "output_top_bucket": "group by ($by, le) (last_over_time(vllm:request_generation_tokens_bucket{$sel}[$w]))",
}
#: the hourly series of the window: preemptions in each hour, and the hour's peak demand
PREEMPTED_HOURS = "sum by ($by) (increase(vllm_capacity_preemptions_total{$sel}[1h]))"
DEMAND_HOURS = (
    "max_over_time((sum by ($by) (vllm_capacity_requests_running{$sel}) + sum by ($by) "
    "(vllm_capacity_requests_waiting{$sel}))[1h:$res])"
)


def promql(template: str, sel: str, window: str) -> str:
    """A query of the table, its placeholders filled in."""
    text = template.replace("$by", BY).replace("$res", RESOLUTION).replace("$w", window).replace("$sel", sel)
    return text.replace("{,", "{")


class AdviseError(Exception):
    """advise cannot answer at all (Prometheus unreachable, nothing matched, too little data): one line, exit 2."""


@dataclass(frozen=True)
class Window:
    """The window read: its text (7d), its length in seconds, and its end (Unix seconds)."""

    text: str
    seconds: float
    end: float


def matchers(selector: str | None) -> str:
    """``{namespace="serving"}`` as the matchers to put after a query's own (a leading comma); "" for none."""
    if not selector:
        return ""
    text = selector.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise AdviseError(f"--selector {selector!r}: a label selector in braces, e.g. '{{namespace=\"serving\"}}'")
    inner = text[1:-1].strip().rstrip(",")
    if not inner:
        return ""
    if not re.fullmatch(r'(\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=|!=|=~|!~)\s*"(?:[^"\\]|\\.)*"\s*,?)+', inner):
        raise AdviseError(f'--selector {selector!r}: matchers like name="value", name=~"regex", comma-separated')
    return "," + inner


def _key(labels: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(labels.get(label, "") for label in GROUP)


HourlyPoints = dict[tuple[str, ...], dict[float, float]]  # deployment -> timestamp -> value


@dataclass(frozen=True)
class _Answers:
    """Every query's answer, over every deployment at once, with the PromQL it was asked as."""

    instant: dict[str, tuple[str, list[Sample]]]  # figure -> (PromQL, vector)
    info: list[Sample]
    preempted: HourlyPoints
    demand: HourlyPoints
    hours: Figure  # the preemptions' range query (its value: each deployment's count, filled in per deployment)


async def _ask(client: PrometheusClient, sel: str, window: Window) -> _Answers:
    """All of advise's queries, side by side."""
    instant = {n: promql(q, sel, window.text) for n, q in {**QUERIES, **TOP_BUCKETS}.items()}
    start = window.end - window.seconds + 3600
    preempted_q, demand_q = promql(PREEMPTED_HOURS, sel, window.text), promql(DEMAND_HOURS, sel, window.text)
    vectors, (preempted, demand) = await asyncio.gather(
        asyncio.gather(*(client.query(q, window.end) for q in [*instant.values(), promql(INFO, sel, window.text)])),
        asyncio.gather(
            client.query_range(preempted_q, start, window.end, 3600),
            client.query_range(demand_q, start, window.end, 3600),
        ),
    )
    return _Answers(
        instant={n: (q, v) for (n, q), v in zip(instant.items(), vectors[:-1], strict=True)},
        info=vectors[-1],
        preempted={_key(s.labels): dict(s.points) for s in preempted},
        demand={_key(s.labels): dict(s.points) for s in demand},
        hours=Figure(None, preempted_q, window.end, start=start, step=3600),
    )


async def observe(client: PrometheusClient, selector: str | None, window: Window) -> list[Observed]:
    """Every deployment the selector matches, over the window. Raises AdviseError where nothing can be advised."""
    sel = matchers(selector)
    try:
        answers = await _ask(client, sel, window)
    except PrometheusError as err:
        raise AdviseError(str(err)) from None
    groups = sorted({_key(s.labels) for s in answers.instant["capacity_tokens"][1]})
    if not groups:
        raise AdviseError(
            f"no vllm_capacity_kv_cache_capacity_tokens{{{sel.lstrip(',')}}} in the {window.text} before "
            f"{_iso(window.end)}: the selector matches no deployment with the sidecar"
        )
    out = []
    for key in groups:
        observed = _observed(key, window, answers)
        span = observed.value("data_seconds") or 0.0
        if span < min(MIN_DATA_SECONDS, window.seconds / 2):
            raise AdviseError(
                f"{'/'.join(k for k in key if k)}: {span / 60:.0f} minutes of data in the {window.text} window: "
                f"advise needs at least {MIN_DATA_SECONDS / 3600:.0f} h"
            )
        out.append(observed)
    return out


def _observed(key: tuple[str, ...], window: Window, answers: _Answers) -> Observed:
    """One deployment's share of the answers."""
    figures = {
        n: Figure(_top(samples, key) if n in TOP_BUCKETS else _value(samples, key), q, window.end)
        for n, (q, samples) in answers.instant.items()
    }
    labels = next((s.labels for s in answers.info if _key(s.labels) == key), {})
    mine = answers.preempted.get(key, {})
    # the hours with preemptions: the points above 0 of this deployment's series of the range query
    hours = replace(answers.hours, value=float(sum(1 for v in mine.values() if v > 0)))
    return Observed(
        group=dict(zip(GROUP, key, strict=True)),
        window=window.text,
        figures=figures,
        info={k: labels[k] for k in ("version", "cache_dtype", "block_size", "gpu_memory_utilization") if k in labels},
        preempted_hours=mine,
        demand_hours=answers.demand.get(key, {}),
        hours=hours,
    )


def _top(samples: list[Sample], key: tuple[str, ...]) -> float | None:
    """The largest finite ``le`` among the group's buckets."""
    bounds = [float(s.labels.get("le", "nan")) for s in samples if _key(s.labels) == key]
    finite = [b for b in bounds if math.isfinite(b)]
    return max(finite) if finite else None


def _value(samples: list[Sample], key: tuple[str, ...]) -> float | None:
    return next((s.value for s in samples if _key(s.labels) == key and not math.isnan(s.value)), None)


def _iso(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
