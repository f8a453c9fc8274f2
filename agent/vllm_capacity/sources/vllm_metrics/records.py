"""vLLM's ``/metrics`` as plain data: the names the agent reads (per metric-name generation), the schema
generations, and the records a parse gives (:mod:`vllm_capacity.sources.vllm_metrics.parse` makes them).

Mostly declarations: the names and their comments are the table of what each vLLM release serves
(``docs/metrics.md`` has it whole).

Facts relied on (vLLM's ``vllm/engine/metrics.py`` (V0) and ``vllm/v1/metrics/loggers.py`` (V1), read per release;
``docs/metrics.md`` tables the generations):

* KV usage is ``vllm:kv_cache_usage_perc`` (V1 >= 0.9.2) or ``vllm:gpu_cache_usage_perc`` (V0; V1 <= 0.11), 0-1.
* Series carry ``model_name``, and from V1 0.8.4 ``engine`` (data-parallel index). V0 has no ``engine``: "0".
* ``vllm:cache_config_info`` carries the cache config as labels; ``"None"`` means unset. It has no ``model_name``;
  from V1 0.9.0 it has ``engine``. ``num_gpu_blocks`` is summed over data-parallel engines on every engine's series;
  ``kv_cache_size_tokens`` and ``kv_cache_max_concurrency`` (>= 0.24) are per engine.
* ``*_created`` families are ignored (the filter never keeps them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

KV_USAGE = "vllm:kv_cache_usage_perc"
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
SWAPPED = "vllm:num_requests_swapped"
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
CACHE_CONFIG = "vllm:cache_config_info"
# Speculative decoding's counters (V0 from 0.4.x, and V1; drafts only in V1 >= 0.8.5), present only when it is on
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
PROCESS_START = "process_start_time_seconds"
# V0 >= 0.6.4, V1 >= 0.8.0 with --enable-lora: labels max_lora and the comma-joined names of the adapters with running /
# waiting requests; the value is when vLLM last recorded it (each new pair of lists is a new series, the old ones stay)
LORA_REQUESTS = "vllm:lora_requests_info"
#: the frontend's queue caps (--max-num-queued-reqs, --max-num-queued-tokens) answering 503: demand shed at the door,
#: by reason; model_name only, no engine label (vllm/v1/metrics/loggers.py, from 0.32)
ADMISSION_REJECTIONS = "vllm:admission_rejections_total"
#: the CPU tier vLLM itself reports, per engine: native offloading's config (0.33:
#: vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py, labels from vllm/v1/kv_offload/cpu/common.py
#: CPUOffloadingInfo) and SimpleCPUOffloadConnector's pool (vllm/v1/simple_kv_offload/metrics.py)
KV_OFFLOAD_CONFIG = "vllm:kv_offload_config_info"
SIMPLE_OFFLOAD_INFO = "vllm:simple_kv_offload_info"
SIMPLE_OFFLOAD_USED = "vllm:simple_kv_offload_used_blocks"
CPU_TIER = (KV_OFFLOAD_CONFIG, SIMPLE_OFFLOAD_INFO, SIMPLE_OFFLOAD_USED)
# V1 >= 0.11.2: 1 on the series of the engine's state: awake, weights_offloaded (sleep level 1), discard_all (2)
SLEEP = "vllm:engine_sleep_state"
# Inter-token latency histograms: the newer name (V0 and V1 >= 0.10.2) and the older one (removed in V1 0.15).
ITL = "vllm:inter_token_latency_seconds"
TPOT = "vllm:time_per_output_token_seconds"
TTFT = "vllm:time_to_first_token_seconds"
ITERATION_TOKENS = "vllm:iteration_tokens_total"  # a histogram despite its name
#: its sum: the tokens the steps computed. Each observation is one step's output batch: the generated tokens plus a
#: prompt's computed tokens when its prefill completes (V1 IterationStats), so under chunked prefill a long prompt is
#: one lump at its last chunk and the steps before it look small; the mean (sum / count) is the steps' true size.
ITERATION_TOKENS_SUM = ITERATION_TOKENS + "_sum"
#: The latency histograms' buckets (the latency-by-concurrency curve): wire name -> kind ("itl" or "ttft").
#: The newer inter-token name is preferred where a server serves both (0.10.2 - 0.14).
LATENCY_BUCKETS = {
    ITL + "_bucket": "itl",
    TPOT + "_bucket": "itl",
    TTFT + "_bucket": "ttft",
    # finished requests' sizes, for the context distribution (max_concurrency{basis="p90_context"})
    "vllm:request_prompt_tokens_bucket": "prompt",
    "vllm:request_generation_tokens_bucket": "generation",
    # tokens per engine step (V0 >= 0.6.4, V1 >= 0.7.3): steps as large as --max-num-batched-tokens allows name the
    # token budget as the limit (concurrency_limit{limit="token_budget"})
    ITERATION_TOKENS + "_bucket": "steps",
}

#: Sample names (as they appear on the wire) the agent reads; lines of other families are never parsed.
WANTED = (
    KV_USAGE,
    GPU_CACHE_USAGE,
    RUNNING,
    WAITING,
    WAITING_BY_REASON,
    SWAPPED,
    PREEMPTIONS,
    GENERATION_TOKENS,
    CACHE_CONFIG,
    PROCESS_START,
    SLEEP,
    SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    LORA_REQUESTS,
    ADMISSION_REJECTIONS,
    *CPU_TIER,
    *LATENCY_BUCKETS,
    ITERATION_TOKENS_SUM,
)
#: WANTED without the latency buckets: what a cycle reads when it does not read latency (they are most of the lines)
WANTED_WITHOUT_LATENCY = tuple(n for n in WANTED if n not in LATENCY_BUCKETS and n != ITERATION_TOKENS_SUM)
#: Families recognised by their HELP/TYPE lines alone: which inter-token latency name is served.
PRESENCE_ONLY = (ITL, TPOT)
#: Names whose HELP/TYPE lines are read beside those of WANTED: the latency histograms' own (their buckets are
#: WANTED), so that the buckets are read inside their families as a parse of the whole body reads them.
META = (ITL, TPOT, TTFT, "vllm:request_prompt_tokens", "vllm:request_generation_tokens", ITERATION_TOKENS)

#: Metric schema generations, as exported in ``vllm_capacity_vllm_info{schema}``.
SCHEMA_V0 = "v0"  # legacy engine: gpu_cache_usage_perc, no engine label
SCHEMA_V1_LEGACY = "v1-legacy"  # V1 0.7.3-0.9.1: gpu_cache_usage_perc only
SCHEMA_V1 = "v1"  # V1 0.9.2-0.23: kv_cache_usage_perc
SCHEMA_V1_CAPACITY = "v1-capacity"  # V1 >= 0.24: kv_cache_size_tokens / kv_cache_max_concurrency in cache_config_info


# vLLM 0.34's CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION (vllm/config/cache.py): the utilization an unset
# gpu_memory_utilization resolves to where the KV cache is not extensible
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92


def label_int(labels: Mapping[str, str], key: str) -> int | None:
    value = label_float(labels, key)
    return int(value) if value is not None and value.is_integer() else None


def label_float(labels: Mapping[str, str], key: str) -> float | None:
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class CacheConfig:
    """``vllm:cache_config_info`` of one engine. ``labels`` holds every label except ``engine``, ``"None"`` dropped.
    The same object serves every scrape with the same labels: its figures are read from them once."""

    labels: Mapping[str, str]

    @functools.cached_property
    def block_size(self) -> int | None:
        return label_int(self.labels, "block_size")

    @functools.cached_property
    def num_gpu_blocks(self) -> int | None:
        """As reported: in V1 this is the sum over all data-parallel engines of the server."""
        return label_int(self.labels, "num_gpu_blocks")

    @functools.cached_property
    def kv_cache_size_tokens(self) -> int | None:
        return label_int(self.labels, "kv_cache_size_tokens")

    @functools.cached_property
    def kv_cache_max_concurrency(self) -> float | None:
        return label_float(self.labels, "kv_cache_max_concurrency")

    @functools.cached_property
    def kv_cache_memory_bytes(self) -> int | None:
        return label_int(self.labels, "kv_cache_memory_bytes")

    @functools.cached_property
    def num_gpu_blocks_override(self) -> int | None:
        return label_int(self.labels, "num_gpu_blocks_override")

    @functools.cached_property
    def gpu_memory_utilization(self) -> float | None:
        """As set (``--gpu-memory-utilization``); from vLLM 0.34 the label says "None" unless it was set."""
        return label_float(self.labels, "gpu_memory_utilization")

    @functools.cached_property
    def extensible_kv_cache(self) -> bool | None:
        """vLLM 0.34's ``enable_extensible_kv_cache`` as its engine settled it (None: an older release)."""
        return {"True": True, "False": False}.get(self.labels.get("enable_extensible_kv_cache", ""))

    @functools.cached_property
    def resolved_gpu_memory_utilization(self) -> tuple[float, str] | None:
        """The utilization vLLM sized memory with, and how it was resolved: "set" (the label's value), or, where
        0.34 says "None", ``CacheConfig.resolved_gpu_memory_utilization`` (vllm/config/cache.py of the 0.34.0
        wheel): 1.0 under the extensible KV cache ("extensible_default"), else DEFAULT_GPU_MEMORY_UTILIZATION 0.92
        ("default"). None where neither the value nor the sizing mode is reported."""
        if (value := self.gpu_memory_utilization) is not None:
            return value, "set"
        if self.extensible_kv_cache is None:
            return None
        return (1.0, "extensible_default") if self.extensible_kv_cache else (DEFAULT_GPU_MEMORY_UTILIZATION, "default")

    @functools.cached_property
    def num_cpu_blocks(self) -> int | None:
        """V0's swap space in blocks (V1 reports "None")."""
        value = label_int(self.labels, "num_cpu_blocks")
        return value if value is not None and value >= 0 else None

    @functools.cached_property
    def kv_offloading_size_gib(self) -> float | None:
        """--kv-offloading-size (V1), in GiB over all TP ranks."""
        return label_float(self.labels, "kv_offloading_size")

    @functools.cached_property
    def cache_dtype(self) -> str | None:
        return self.labels.get("cache_dtype")


#: one engine of one model, as vLLM labels its series: (model_name, engine), ``engine`` the data-parallel index ("0")
EngineKey = tuple[str, str]


@dataclass(frozen=True)
class EngineMetrics:
    """What one engine (``model_name``, ``engine``) reports. ``None`` means vLLM did not report it."""

    model_name: str
    engine: str
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    waiting_by_reason: Mapping[str, float] = field(default_factory=dict)
    swapped: float | None = None
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None
    cache_config: CacheConfig | None = None
    #: kind ("itl", "ttft", "prompt", "generation") -> the histogram's cumulative buckets, (upper bound, count)
    #: ascending, +Inf last
    latency: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    #: vllm:engine_sleep_state's state at 1: awake, weights_offloaded, discard_all (None: not reported)
    sleep_state: str | None = None
    #: speculative decoding's counters since vLLM started: drafts proposed (V1), draft tokens, accepted tokens
    spec_drafts_total: float | None = None
    spec_draft_tokens_total: float | None = None
    spec_accepted_tokens_total: float | None = None
    #: vllm:iteration_tokens_total's sum (read with the latency buckets): the tokens the engine's steps computed
    step_tokens_sum: float | None = None
    #: the CPU tier as vLLM reports it: native offloading's tokens at max_model_len (summed over its series),
    #: SimpleCPUOffloadConnector's pool and the blocks of it in use (None: not reported)
    offload_tokens: float | None = None
    simple_offload_blocks: float | None = None
    simple_offload_used_blocks: float | None = None

    @property
    def waiting_for_capacity(self) -> float | None:
        return self.waiting_by_reason.get("capacity")


@dataclass(frozen=True)
class LoraRequests:
    """The newest ``vllm:lora_requests_info`` series (the largest value: when vLLM last recorded it): ``--max-loras``
    and the adapter lists of its ``running_lora_adapters`` and ``waiting_lora_adapters`` labels (what they mean per
    engine: :func:`vllm_capacity.derive.lora_slots`). It has no ``model_name`` or ``engine`` label: it is the
    server's (vLLM warns it misleads under data parallelism). ``max_loras`` None: the label is not a count."""

    max_loras: int | None
    running: tuple[str, ...]
    waiting: tuple[str, ...]

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> LoraRequests:
        text = labels.get("max_lora", "")
        slots = int(text) if text.isdigit() else None

        def names(key: str) -> tuple[str, ...]:
            return tuple(n for n in labels.get(key, "").split(",") if n)

        return cls(slots, names("running_lora_adapters"), names("waiting_lora_adapters"))


@dataclass(frozen=True)
class VllmMetrics:
    """One scrape of vLLM's /metrics, reduced to what capacity derivations need."""

    schema: str
    engines: tuple[EngineMetrics, ...]
    #: Number of engines with a cache_config_info series: the data-parallel size ``num_gpu_blocks`` is summed over.
    dp_engines: int
    process_start_time_seconds: float | None = None
    #: The inter-token latency histogram this server exposes (the name changed in 0.10.2), or None.
    itl_metric: str | None = None
    #: Families (and cache_config_info labels) whose value could not be right this scrape; those values are left out.
    implausible: tuple[str, ...] = ()
    #: LoRA's slots and adapters (None: vLLM serves without --enable-lora, or a release before the family)
    lora: LoraRequests | None = None
    #: Families left out of this read for passing the selection's bounds (vllm_select), each with why: (family, why).
    over_limit: tuple[tuple[str, str], ...] = ()
    #: vllm:admission_rejections_total by (model_name, reason), since vLLM started (empty: not reported)
    admission_rejections: Mapping[tuple[str, str], float] = field(default_factory=dict)
