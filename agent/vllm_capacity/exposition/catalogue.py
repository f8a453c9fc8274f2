"""Every metric the agent exports: name, type, labels, HELP (which says where the value comes from) and, for the
per-engine metrics, how each series' value is read from the engine's record.

This table is the contract that dashboards, alerts and users rely on; the table in docs/metrics.md is checked
against it by the test suite. Exposition (:mod:`vllm_capacity.exposition.render`) refuses names that are not here, and
emits every per-engine metric by looping over this table: adding one is a row here plus its derivation. As long as
the catalogue is, one row per metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_capacity.derive import LIMITS

if TYPE_CHECKING:
    from vllm_capacity.derive import EngineCapacity
    from vllm_capacity.sources.gpu import GpuReading


EngineValue = Callable[["EngineCapacity"], float | None]
#: For a per-engine metric with several labels after model_name and engine: the engine's series, as (values of
#: those labels, value) pairs.
EngineRows = Callable[["EngineCapacity"], Iterable[tuple[tuple[str, ...], float]]]
GpuValue = Callable[["GpuReading"], float | None]

NAMESPACE = "vllm_capacity"
ENGINE_LABELS = ("model_name", "engine")
GPU_LABELS = ("gpu", "uuid")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "gauge", "counter" or "info"
    labels: tuple[str, ...]
    help: str
    #: For info metrics: the labels that carry the information (``labels`` identify the series).
    info_labels: tuple[str, ...] = ()
    #: For per-engine metrics: (value of the label after model_name and engine, or None when there is none, how the
    #: value is read from the engine's record). One series per engine and entry; a None value is left out.
    engine_values: tuple[tuple[str | None, EngineValue], ...] = ()
    #: For per-engine metrics with several labels of their own: every series of an engine.
    engine_rows: EngineRows | None = None
    #: For per-GPU metrics of one series a GPU: how the value is read from NVML's reading of it.
    gpu_value: GpuValue | None = None

    @property
    def all_labels(self) -> tuple[str, ...]:
        return self.labels + self.info_labels


def _m(
    name: str,
    kind: str,
    labels: tuple[str, ...],
    help_text: str,
    info: tuple[str, ...] = (),
    *,
    value: EngineValue | None = None,
    by: tuple[tuple[str, EngineValue], ...] = (),
    rows: EngineRows | None = None,
) -> MetricSpec:
    """A catalogue row; a per-engine metric gives ``value`` (one series per engine), ``by`` (one per label value)
    or ``rows`` (its series, for several labels of its own)."""
    engine_values = ((None, value),) if value is not None else by
    return MetricSpec(f"{NAMESPACE}_{name}", kind, labels, help_text, info, engine_values, rows)


def _gpu(name: str, help_text: str, read: GpuValue) -> MetricSpec:
    """A catalogue row of a per-GPU gauge, one series a GPU: ``read`` gives its value from NVML's reading."""
    return MetricSpec(f"{NAMESPACE}_{name}", "gauge", GPU_LABELS, help_text, gpu_value=read)


# values of the basis label of max_concurrency and concurrency_utilization_ratio
BASIS_MAX_MODEL_LEN = "max_model_len"  # requests of max_model_len tokens: vLLM's "Maximum concurrency" figure
BASIS_OBSERVED = "observed_context"  # requests of the mean context of the running ones
BASIS_P90_CONTEXT = "p90_context"  # requests of the 90th-percentile size of finished ones (prompt + generation)
BASIS_SLO = "slo"  # the largest concurrency at which the latency objectives held (--slo-itl, --slo-ttft)
BASIS_SUSTAINED = "sustained"  # the running requests vLLM holds while requests wait for capacity or are preempted


def _latency_quantiles(e: EngineCapacity) -> Iterable[tuple[tuple[str, ...], float]]:
    for (kind, running, q), seconds in e.latency.quantiles.items():
        yield (kind, f"p{q * 100:g}", str(running)), seconds


def _latency_observations(e: EngineCapacity) -> Iterable[tuple[tuple[str, ...], float]]:
    for (kind, running), count in e.latency.observations.items():
        yield (kind, str(running)), count


def _limit(e: EngineCapacity) -> Iterable[tuple[tuple[str, ...], float]]:
    if e.concurrency_limit is not None:
        for limit in LIMITS:
            if (
                (limit != "lora_slots" or e.lora is not None)
                and (limit != "token_budget" or e.token_budget_fill_ratio is not None)
                and (limit != "queue_cap" or e.shedding is not None)
            ):
                yield (limit,), 1.0 if limit == e.concurrency_limit else 0.0


def _layout(what: str) -> EngineRows:
    def rows(e: EngineCapacity) -> Iterable[tuple[tuple[str, ...], float]]:
        if e.layout is not None:
            for kind, n in getattr(e.layout, what).items():
                yield (kind,), float(n)

    return rows


def _headroom(e: EngineCapacity) -> Iterable[tuple[tuple[str, ...], float]]:
    if e.headroom_requests is not None and e.headroom_basis is not None:
        yield (e.headroom_basis,), e.headroom_requests


E = ENGINE_LABELS
G = GPU_LABELS
# NVML's clock-event reasons that lower the clocks without throttling the work: the GPU idles, or its clocks were set
# so by the application or an administrator. Exported apart (gpu_clock_event), never as gpu_throttled.
NOT_THROTTLING = frozenset({"gpu_idle", "applications_clocks_setting"})

SPECS: tuple[MetricSpec, ...] = (
    _m("up", "gauge", (), "1 if the last scrape of vLLM's /metrics succeeded, 0 if not (vLLM down, or not vLLM)."),
    _m(
        "kv_cache_capacity_tokens",
        "gauge",
        E,
        "KV-cache capacity in tokens: vLLM's cache_config_info kv_cache_size_tokens (>=0.24), "
        "else num_gpu_blocks per engine x block_size.",
        value=lambda e: e.capacity_tokens,
    ),
    _m(
        "kv_cache_used_tokens",
        "gauge",
        E,
        "KV-cache tokens held by live requests: vllm:kv_cache_usage_perc (or gpu_cache_usage_perc) x capacity.",
        value=lambda e: e.used_tokens,
    ),
    _m(
        "kv_cache_free_tokens",
        "gauge",
        E,
        "KV-cache tokens free for new work: capacity - used (prefix cache counts free).",
        value=lambda e: e.free_tokens,
    ),
    _m(
        "kv_cache_usage_ratio",
        "gauge",
        E,
        "Fraction of KV-cache blocks held by live requests, 0-1: vllm:kv_cache_usage_perc (V0: gpu_cache_usage_perc).",
        value=lambda e: e.usage_ratio,
    ),
    _m(
        "kv_cache_blocks",
        "gauge",
        E,
        "KV-cache blocks of this engine: cache_config_info num_gpu_blocks (V1: divided by the data-parallel engines).",
        value=lambda e: e.blocks,
    ),
    _m(
        "kv_cache_block_size_tokens",
        "gauge",
        E,
        "Tokens per KV-cache block: cache_config_info block_size.",
        value=lambda e: e.block_size,
    ),
    _m(
        "kv_cache_bytes_per_token",
        "gauge",
        (*E, "method"),
        "KV-cache bytes per token per GPU rank. method=cache_config: kv_cache_memory_bytes / capacity; "
        "startup_log: the log's KV memory / KV tokens (both after warm-up under vLLM 0.34's extensible KV cache); "
        "model_config: from config.json geometry, TP and KV dtype "
        "(with the layers of the speculative drafter vLLM's log names, where the agent plans it).",
        by=(
            ("cache_config", lambda e: e.kv_bytes_per_token_cache_config),
            ("startup_log", lambda e: e.kv_bytes_per_token_startup_log),
            ("model_config", lambda e: e.kv_bytes_per_token_model_config),
        ),
    ),
    _m(
        "kv_cache_cpu_capacity_tokens",
        "gauge",
        E,
        "KV-cache capacity of the CPU tier in tokens, for prefix reuse (not concurrency): vLLM's own figure where it "
        "reports one (vllm:kv_offload_config_info cpu_kv_cache_size_tokens, >=0.33; vllm:simple_kv_offload_info "
        "capacity_blocks x block_size), else V0's swap space (cache_config_info num_cpu_blocks x block_size) or V1's "
        "native KV offloading planned (kv_offloading_size, vLLM 0.32's page-aligned chunks of every rank's block "
        "bytes) when --model-config gives the bytes per block; absent for an MLA model under TP alone, whose one or "
        "many copies vLLM does not report.",
        value=lambda e: e.cpu_capacity_tokens,
    ),
    _m(
        "kv_cache_cpu_used_tokens",
        "gauge",
        E,
        "CPU-tier tokens in use: vllm:simple_kv_offload_used_blocks x block_size (blocks pinned by transfers or "
        "cache hits; SimpleCPUOffloadConnector only, the one that reports it).",
        value=lambda e: e.cpu_used_tokens,
    ),
    _m(
        "lora_slots",
        "gauge",
        E,
        "LoRA adapters one batch can serve (vLLM's --max-loras): vllm:lora_requests_info's max_lora label. Absent "
        "without --enable-lora, and with several data-parallel engines (vLLM keeps one series for all of them).",
        value=lambda e: e.lora.slots if e.lora else None,
    ),
    _m(
        "lora_running_adapters",
        "gauge",
        E,
        "LoRA adapters with requests in vLLM's batch: the newest vllm:lora_requests_info series' running_lora_adapters "
        "(0 while vLLM reports no request running: it records the series only while it steps). Against lora_slots: "
        "at it, a request for another adapter waits (concurrency_limit{limit=lora_slots}).",
        value=lambda e: len(e.lora.running) if e.lora else None,
    ),
    _m(
        "kv_cache_groups",
        "gauge",
        (*E, "group_kind"),
        "vLLM's KV-cache groups by layer kind (full, sliding, chunked, mla, mamba, linear), as the planner lays them "
        "out from --model-config for vLLM's own KV memory, block size and version. Absent without --model-config.",
        rows=_layout("groups"),
    ),
    _m(
        "kv_cache_blocks_per_request",
        "gauge",
        (*E, "group_kind"),
        "KV-cache blocks one request of max_model_len holds in the groups of a layer kind (their sum is what "
        "max_concurrency{basis=max_model_len} divides the blocks by): the planner's layout from --model-config.",
        rows=_layout("blocks_per_request"),
    ),
    _m(
        "kv_cache_plan_mismatch",
        "gauge",
        E,
        "1 when vLLM's capacity in tokens differs from the planner's (--model-config, vLLM's own KV memory and "
        "settings) by more than one block per group, 0 when they agree. Absent without --model-config.",
        value=lambda e: None if e.layout is None or e.layout.mismatch is None else float(e.layout.mismatch),
    ),
    _m(
        "kv_cache_pool_bytes",
        "gauge",
        E,
        "KV-cache memory per GPU rank: the startup log's 'Available KV cache memory' (vLLM 0.34's extensible KV "
        "cache: 'Extended KV cache to N blocks (X GiB)', the pool after warm-up, never the estimate before it), else "
        "kv_cache_memory_bytes.",
        value=lambda e: e.kv_pool_bytes,
    ),
    _m(
        "model_weights_bytes",
        "gauge",
        E,
        "Model weights per GPU rank: the startup log's 'Model loading took'.",
        value=lambda e: e.weights_bytes,
    ),
    _m(
        "cuda_graph_bytes",
        "gauge",
        E,
        "CUDA graph memory per GPU rank: the startup log's 'Graph capturing ... took'.",
        value=lambda e: e.cuda_graph_bytes,
    ),
    _m(
        "activation_peak_bytes",
        "gauge",
        E,
        "Activation peak per GPU rank from vLLM's memory profile in the startup log (V0; V1 at debug level).",
        value=lambda e: e.activation_peak_bytes,
    ),
    _m(
        "max_model_len_tokens",
        "gauge",
        E,
        "Longest request context vLLM accepts: /v1/models max_model_len.",
        value=lambda e: e.max_model_len,
    ),
    _m(
        "max_concurrency",
        "gauge",
        (*E, "basis"),
        "Requests whose KV cache fits at once. basis=max_model_len: vLLM's 'Maximum concurrency' figure; "
        "basis=observed_context: capacity / mean context of running requests; basis=slo: the largest running "
        "requests at which the latency objectives held (--slo-itl/--slo-ttft, from vLLM's latency histograms); "
        "basis=p90_context: capacity / (p90 prompt + p90 generation tokens of finished requests); "
        "basis=sustained: the running requests vLLM holds while requests wait for capacity or are preempted, a mean "
        "over the agent's reads halving every --latency-half-life (any limit: KV cache, --max-num-seqs, token "
        "budget, CPU; a read with none running is left out), or the most seen running until then "
        "(sustained_queue_observed 0).",
        by=(
            (BASIS_MAX_MODEL_LEN, lambda e: e.max_concurrency),
            (BASIS_OBSERVED, lambda e: e.max_concurrency_observed),
            (BASIS_SLO, lambda e: e.latency.slo_max_concurrency),
            (BASIS_P90_CONTEXT, lambda e: e.max_concurrency_p90_context),
            (BASIS_SUSTAINED, lambda e: e.sustained.level if e.sustained else None),
        ),
    ),
    _m(
        "concurrency_utilization_ratio",
        "gauge",
        (*E, "basis"),
        "Running requests / max_concurrency of the same basis (above 1 at max_model_len when requests are short).",
        by=(
            (BASIS_MAX_MODEL_LEN, lambda e: e.concurrency_utilization),
            (BASIS_OBSERVED, lambda e: e.concurrency_utilization_observed),
            (BASIS_SLO, lambda e: e.concurrency_utilization_slo),
            (BASIS_SUSTAINED, lambda e: e.concurrency_utilization_sustained),
        ),
    ),
    _m(
        "slo_knee_observed",
        "gauge",
        E,
        "1 once traffic was seen to break a latency objective at some concurrency (then max_concurrency{basis=slo} "
        "is the knee), 0 if not yet (it is a lower bound). Absent without --slo-itl/--slo-ttft.",
        value=lambda e: None if e.latency.slo_knee_observed is None else float(e.latency.slo_knee_observed),
    ),
    _m(
        "sustained_queue_observed",
        "gauge",
        E,
        "1 once the agent read requests waiting for capacity (or a preemption) at this engine: then "
        "max_concurrency{basis=sustained} is the level vLLM holds under pressure; 0 if not yet (it is the most "
        "requests seen running, a lower bound).",
        value=lambda e: None if e.sustained is None else float(e.sustained.observed),
    ),
    _m(
        "headroom_requests",
        "gauge",
        (*E, "basis"),
        "Requests this engine can still take. basis=queue: requests wait for capacity now (vllm:num_requests_waiting"
        "_by_reason, else _waiting): minus their number; basis=queue_cap: vLLM's queue caps rejected requests "
        "since the last read (vllm:admission_rejections_total): at most 0; basis=preemption: vLLM preempted since "
        "the last read: at most 0; otherwise the smallest known max_concurrency (observed_context, slo, sustained "
        "once observed) minus running, basis the one that binds.",
        rows=_headroom,
    ),
    _m(
        "engine_asleep",
        "gauge",
        E,
        "1 while vLLM's sleep mode has freed the KV cache (weights_offloaded or discard_all), 0 when awake: "
        "vllm:engine_sleep_state (>=0.11.2). While asleep free tokens read 0 and headroom and the limit are absent.",
        value=lambda e: None if e.asleep is None else float(e.asleep),
    ),
    _m(
        "concurrency_limit",
        "gauge",
        (*E, "limit"),
        "1 for what limits concurrency now, 0 for the others: queue_cap (vLLM's --max-num-queued-reqs or "
        "--max-num-queued-tokens rejected requests since the last read, vllm:admission_rejections_total; where vLLM "
        "reports it), kv_cache (requests were preempted, or wait on a "
        "nearly full cache), max_num_seqs (running at vLLM's --max-num-seqs), lora_slots (requests for an adapter "
        "wait while --max-loras slots hold others; with --enable-lora only), token_budget (requests wait while the "
        "engine's steps are nearly as large as --max-num-batched-tokens allows; once the budget is known), slo "
        "(running above max_concurrency{basis=slo}), none (nothing waits). Absent when requests wait for a reason "
        "none names.",
        rows=_limit,
    ),
    _m(
        "token_budget_fill_ratio",
        "gauge",
        E,
        "How full vLLM's engine steps were over the last ~5 s: the tokens they computed per step (the increase of "
        "vllm:iteration_tokens_total's sum over its count) over the token budget per step (--max-num-batched-tokens, "
        "from the agent's flag or vLLM's log), at most 1. Near 1, steps are as large as the scheduler allows. Absent "
        "without the budget or with under 20 steps in the window.",
        value=lambda e: e.token_budget_fill_ratio,
    ),
    _m(
        "latency_by_concurrency_seconds",
        "gauge",
        (*E, "latency", "percentile", "running"),
        "Latency (itl: inter-token, ttft: time to first token) at a percentile (p50, p90, p99), by running requests "
        "(the bin's upper bound): vLLM's latency histograms, their increase attributed to the concurrency of each "
        "interval, decayed with a half-life of traffic (--latency-half-life). Present once the bin has "
        "10 / (1 - quantile) observations (1,000 for p99).",
        rows=_latency_quantiles,
    ),
    _m(
        "latency_by_concurrency_observations",
        "gauge",
        (*E, "latency", "running"),
        "Observations (decayed) behind latency_by_concurrency_seconds in each running-requests bin.",
        rows=_latency_observations,
    ),
    _m(
        "mean_context_tokens",
        "gauge",
        E,
        "Mean KV-cache tokens per running request: used tokens / vllm:num_requests_running (absent when idle).",
        value=lambda e: e.mean_context_tokens,
    ),
    _m(
        "requests_running",
        "gauge",
        E,
        "Requests in model execution batches: vllm:num_requests_running.",
        value=lambda e: e.running,
    ),
    _m(
        "requests_waiting",
        "gauge",
        E,
        "Requests queued: vllm:num_requests_waiting.",
        value=lambda e: e.waiting,
    ),
    _m(
        "requests_waiting_for_capacity",
        "gauge",
        E,
        "Requests queued for scheduling capacity, KV blocks or batch slots at --max-num-seqs (vLLM counts both): "
        "vllm:num_requests_waiting_by_reason{reason=capacity} (>=0.20).",
        value=lambda e: e.waiting_for_capacity,
    ),
    _m(
        "requests_waiting_deferred",
        "gauge",
        E,
        "Requests queued but deferred (not for lack of KV cache: structured output, LoRA or encoder limits...): "
        "vllm:num_requests_waiting_by_reason{reason=deferred}.",
        value=lambda e: e.waiting_deferred,
    ),
    _m(
        "requests_swapped",
        "gauge",
        E,
        "Requests swapped to CPU memory: vllm:num_requests_swapped (legacy V0 only).",
        value=lambda e: e.swapped,
    ),
    _m(
        "preemptions_total",
        "counter",
        E,
        "Requests preempted for lack of KV cache: vllm:num_preemptions_total, carried across vLLM restarts.",
        value=lambda e: e.preemptions_total,
    ),
    _m(
        "requests_rejected_total",
        "counter",
        ("model_name", "reason"),
        "Requests vLLM's frontend refused (HTTP 503) at a queue cap, by reason (max_num_queued_reqs, "
        "max_num_queued_tokens): vllm:admission_rejections_total (>=0.32, per model, no engine label), carried "
        "across vLLM restarts. Demand that never waited: it is not in requests_waiting.",
    ),
    _m(
        "vllm_info",
        "info",
        E,
        "vLLM metadata: metric schema generation (v0, v1-legacy, v1, v1-capacity), /version, the inter-token "
        "latency histogram it serves, cache_config_info.",
        (
            "schema",
            "version",
            "itl_metric",
            "block_size",
            "cache_dtype",
            "gpu_memory_utilization",
            "enable_prefix_caching",
        ),
    ),
    _m(
        "gpu_up",
        "gauge",
        G,
        "1 while NVML reads the GPU, 0 while it cannot read a GPU it read before (lost, needing a reset, no "
        "permission) and still reads the others: NVML per-device calls.",
    ),
    _gpu("gpu_memory_total_bytes", "GPU memory: NVML nvmlDeviceGetMemoryInfo total.", lambda g: g.memory_total_bytes),
    _gpu(
        "gpu_memory_used_bytes",
        "GPU memory allocated by processes and their contexts: NVML memory info v2 used (total = reserved + used + "
        "free). Drivers without v2 (before 510): v1 used, which counts the driver's reservation too (reserved then "
        "absent).",
        lambda g: g.memory_used_bytes,
    ),
    _gpu("gpu_memory_free_bytes", "GPU memory free: NVML nvmlDeviceGetMemoryInfo free.", lambda g: g.memory_free_bytes),
    _gpu(
        "gpu_memory_reserved_bytes",
        "GPU memory the driver reserves: NVML memory info v2 reserved.",
        lambda g: g.memory_reserved_bytes,
    ),
    _gpu(
        "gpu_utilization_ratio",
        "Share of time a kernel ran, 0-1: NVML nvmlDeviceGetUtilizationRates gpu.",
        lambda g: g.utilization_ratio,
    ),
    _gpu(
        "gpu_memory_bandwidth_utilization_ratio",
        "Share of time memory was read or written, 0-1: NVML nvmlDeviceGetUtilizationRates memory.",
        lambda g: g.memory_bandwidth_utilization_ratio,
    ),
    _gpu("gpu_power_watts", "Power draw: NVML nvmlDeviceGetPowerUsage.", lambda g: g.power_watts),
    _gpu(
        "gpu_power_limit_watts",
        "Enforced power limit: NVML nvmlDeviceGetEnforcedPowerLimit.",
        lambda g: g.power_limit_watts,
    ),
    _gpu("gpu_temperature_celsius", "GPU temperature: NVML nvmlDeviceGetTemperature.", lambda g: g.temperature_celsius),
    _gpu("gpu_sm_clock_hertz", "SM clock: NVML nvmlDeviceGetClockInfo(NVML_CLOCK_SM).", lambda g: g.sm_clock_hertz),
    _gpu(
        "gpu_sm_clock_max_hertz",
        "Maximum SM clock: NVML nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM).",
        lambda g: g.sm_clock_max_hertz,
    ),
    _m(
        "gpu_throttled",
        "gauge",
        (*G, "reason"),
        "1 while the GPU's clocks are throttled for this reason (sw_power_cap, hw_thermal_slowdown, hw_slowdown, "
        "...): NVML clocks event reasons, less gpu_idle and applications_clocks_setting (gpu_clock_event).",
    ),
    _m(
        "gpu_clock_event",
        "gauge",
        (*G, "reason"),
        "1 while clocks are lowered for a reason that is not throttling: gpu_idle (nothing runs), "
        "applications_clocks_setting (clocks set by the application or an administrator): NVML clocks event reasons.",
    ),
    _m(
        "gpu_process_memory_bytes",
        "gauge",
        (*G, "pid", "owner"),
        "GPU memory of each compute process, owner vllm or other: NVML nvmlDeviceGetComputeRunningProcesses.",
    ),
    _m(
        "gpu_memory_bytes",
        "gauge",
        (*G, "component"),
        "The GPU's memory by what holds it: weights, kv_cache, vllm_runtime, other_processes, system, free (sum = "
        "total). NVML with vLLM's startup log and metrics.",
    ),
    _m(
        "gpu_memory_budget_bytes",
        "gauge",
        G,
        "vLLM's memory budget on this GPU: NVML total x cache_config_info gpu_memory_utilization, resolved as vLLM "
        "resolves it where the label says None (0.34: 1.0 under enable_extensible_kv_cache, else 0.92).",
    ),
    _m(
        "gpu_info",
        "info",
        G,
        "GPU identity from NVML: its name, and the parent GPU's UUID for a MIG instance.",
        ("name", "mig_parent"),
    ),
    _m("build_info", "info", (), "vllm-capacity build: version and Python version.", ("version", "python_version")),
    _m(
        "source_up",
        "gauge",
        ("source",),
        "1 if the last read of a source (vllm, vllm_models, vllm_log, nvml) succeeded, 0 if not; agent: 0 while "
        "the agent's last cycle crashed (a bug: source_errors_total{source=agent,reason=internal} counts them, the "
        "log has the traceback).",
    ),
    _m("source_duration_seconds", "gauge", ("source",), "Seconds the last read of a source took."),
    _m(
        "source_errors_total",
        "counter",
        ("source", "reason"),
        "Failed reads of a source, by reason (connect, timeout, http_5xx, parse_error, body_too_large, ...).",
    ),
    _m(
        "http_errors_total",
        "counter",
        ("kind",),
        "Connections and requests the sidecar's own listener refused or failed, by kind (header_timeout, "
        "over_connection_limit, evicted_slow_client, evicted_idle_keepalive, tls_handshake_failed, "
        "tls_handshake_timeout, tls_error, credential_checks_over_limit, bad_request, accept).",
    ),
    _m(
        "last_update_timestamp_seconds",
        "gauge",
        (),
        "Unix time of the last successful vLLM scrape the derived metrics come from.",
    ),
)
del E, G
BY_NAME = {s.name: s for s in SPECS}
