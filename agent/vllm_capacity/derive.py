"""Capacity derivations: plain functions over plain data, no I/O.

Every formula here follows where vLLM defines it (``vllm/v1/core/kv_cache_utils.py``, ``vllm/v1/metrics/loggers.py``;
the formulas are tabled in ``docs/metrics.md``). A value that cannot be known is ``None``, never 0: the exposition
drops ``None`` series instead of exporting a wrong number. Over 300 lines for a reason: every per-engine formula
sits beside the others, each a few lines, with the table below as their index.

Per engine (``model_name``, ``engine``):

``capacity_tokens``
    vLLM's own ``kv_cache_size_tokens`` (V1 >= 0.24, group-aware), else ``blocks_per_engine x block_size``.
``blocks_per_engine``
    ``num_gpu_blocks`` as reported; V1 sums it over data-parallel engines, so it is divided by their number.
``used_tokens = usage_ratio x capacity_tokens``, ``free_tokens = capacity_tokens - used_tokens``
    The usage ratio counts blocks referenced by live requests; evictable prefix-cache blocks count as free.
``max_concurrency{basis="max_model_len"}``
    vLLM's own ``kv_cache_max_concurrency`` (>= 0.24), else vLLM's formula for the generation:
    V0 and V1 <= 0.9.0 ``blocks x block_size / max_model_len``; V1 >= 0.9.1 ``blocks / ceil(max_model_len /
    block_size)`` (the uniform full-attention case of ``get_max_concurrency_for_kv_cache_config``).
``mean_context_tokens = used_tokens / running``
    Average KV footprint of a running request (block-granular), only while requests run.
``max_concurrency{basis="observed_context"} = capacity_tokens / mean_context_tokens``
    How many requests of the size actually being served fit at once.
``concurrency_utilization{basis} = running / max_concurrency{basis}``
``kv_bytes_per_token``, three ways (per GPU rank):
    ``cache_config``: ``kv_cache_memory_bytes / capacity`` when vLLM was given a fixed KV budget;
    ``startup_log``: 'Available KV cache memory' / 'KV cache size' tokens from vLLM's log;
    ``model_config``: ``2 x layers per rank x max(1, kv_heads // tp) x head_dim x kv dtype bytes`` (MLA: 1 x latent).

When /metrics lacks them (V1 0.8.x reports ``num_gpu_blocks="None"``), capacity, max concurrency and
max_model_len come from the startup log.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_capacity import sizing
from vllm_capacity.geometry import Geometry
from vllm_capacity.sources.vllm_log import EngineFigures
from vllm_capacity.sources.vllm_parse import (
    SCHEMA_V0,
    SCHEMA_V1,
    SCHEMA_V1_CAPACITY,
    SCHEMA_V1_LEGACY,
    CacheConfig,
    EngineMetrics,
    LoraRequests,
    VllmMetrics,
)


def blocks_per_engine(num_gpu_blocks: int | None, dp_engines: int, schema: str) -> int | None:
    """Per-engine KV blocks. V1 reports the sum over its data-parallel engines; V0 has no data parallelism."""
    if num_gpu_blocks is None:
        return None
    if schema == SCHEMA_V0:
        return num_gpu_blocks
    return num_gpu_blocks // max(1, dp_engines)


def capacity_tokens(kv_cache_size_tokens: int | None, blocks: int | None, block_size: int | None) -> int | None:
    """KV-cache capacity of one engine in tokens: vLLM's own figure when it reports one, else blocks x block_size."""
    if kv_cache_size_tokens is not None:
        return kv_cache_size_tokens
    if blocks is None or block_size is None:
        return None
    return blocks * block_size


def used_tokens(usage_ratio: float | None, capacity: int | None) -> float | None:
    """Tokens held by live requests: usage ratio x capacity (block-granular)."""
    if usage_ratio is None or capacity is None:
        return None
    return min(max(usage_ratio, 0.0), 1.0) * capacity


def free_tokens(capacity: int | None, used: float | None) -> float | None:
    if capacity is None or used is None:
        return None
    return capacity - used


# The oldest release of each metric generation: whose sizing rules apply when vLLM's /version cannot be read.
# (V1 0.9.1 already counts whole blocks per request; SCHEMA_V1_LEGACY spans it, and the two differ by < 1 block.)
GENERATION_OLDEST = {
    SCHEMA_V0: (0, 3, 3),
    SCHEMA_V1_LEGACY: (0, 7, 3),
    SCHEMA_V1: (0, 9, 2),
    SCHEMA_V1_CAPACITY: (0, 24, 0),
}


def sizing_rules(schema: str, version: str | None) -> tuple[str, tuple[int, int, int]]:
    """The engine (v0, v1) and the release whose sizing rules apply: vLLM's /version when it answered, else the
    oldest release of the metric generation it serves."""
    engine = "v0" if schema == SCHEMA_V0 else "v1"
    if version:
        with contextlib.suppress(ValueError):
            return engine, sizing.parse_version(version)
    return engine, GENERATION_OLDEST.get(schema, GENERATION_OLDEST[SCHEMA_V1])


def max_concurrency_at_max_model_len(
    *,
    reported: float | None,
    blocks: int | None,
    block_size: int | None,
    max_model_len: int | None,
    engine: str,
    version: tuple[int, int, int],
) -> float | None:
    """Requests of exactly ``max_model_len`` tokens that fit in the KV cache ("Maximum concurrency ... 6.37x"):
    vLLM's own figure when it reports one, else its formula for ``engine`` and ``version``."""
    if reported is not None:
        return reported
    if blocks is None or block_size is None or not max_model_len or block_size <= 0:
        return None
    return sizing.max_concurrency(blocks, block_size, max_model_len, engine=engine, version=version)


def mean_context_tokens(used: float | None, running: float | None) -> float | None:
    """Average KV tokens per running request; unknown while nothing runs."""
    if used is None or not running or running <= 0:
        return None
    return used / running


def max_concurrency_at_context(capacity: int | None, context_tokens: float | None) -> float | None:
    """How many requests of ``context_tokens`` each fit in ``capacity`` tokens."""
    if capacity is None or not context_tokens or context_tokens <= 0:
        return None
    return capacity / context_tokens


def concurrency_utilization(running: float | None, max_concurrency: float | None) -> float | None:
    if running is None or not max_concurrency or max_concurrency <= 0:
        return None
    return running / max_concurrency


def headroom(running: float | None, bounds: Mapping[str, float | None]) -> tuple[float | None, str | None]:
    """Requests this engine can still take: the smallest known max concurrency (by basis) minus running, and the
    basis that binds. (None, None) when nothing bounds it or running is unknown."""
    known = {basis: v for basis, v in bounds.items() if v is not None}
    if running is None or not known:
        return None, None
    basis = min(known, key=lambda b: known[b])
    return known[basis] - running, basis


# concurrency_limit's values, in the order they are tried (lora_slots only where vLLM serves LoRA)
LIMITS = ("kv_cache", "max_num_seqs", "lora_slots", "slo", "none")


def concurrency_limit(
    *,
    running: float | None,
    waiting: float | None,
    waiting_for_capacity: float | None,
    preempted: bool,
    usage: float | None,
    max_num_seqs: int | None,
    slo_max_concurrency: int | None,
    lora_blocked: bool = False,
) -> str | None:
    """What limits concurrency now: ``kv_cache`` (requests were preempted since the last read, or requests wait on
    a nearly full cache), ``max_num_seqs`` (running at vLLM's --max-num-seqs), ``lora_slots`` (requests for an
    adapter wait while vLLM's --max-loras slots hold others), ``slo`` (running above the SLO-bound concurrency),
    ``none`` (nothing waits). None when requests wait for a reason none of these names: vLLM counts a
    request as waiting for "capacity" for any scheduling limit (a batch slot, the step's token budget), so that
    reason alone, on a cache with room, does not name the KV cache (measured on vLLM 0.32)."""
    if preempted:
        return "kv_cache"
    if max_num_seqs is not None and running is not None and running >= max_num_seqs:
        return "max_num_seqs"
    if (waiting or 0) > 0 and usage is not None and usage >= NEARLY_FULL:
        return "kv_cache"
    if lora_blocked:
        return "lora_slots"
    if slo_max_concurrency is not None and running is not None and running > slo_max_concurrency:
        return "slo"
    if waiting is not None and waiting == 0:
        return "none"
    return None


NEARLY_FULL = 0.9  # usage at which a queue is taken for one waiting on the cache when vLLM does not say


@dataclass(frozen=True)
class LatencyView:
    """What the agent learned of an engine's latency by concurrency (:mod:`vllm_capacity.latency`), for export."""

    quantiles: Mapping[tuple[str, int, float], float] = field(default_factory=dict)  # (kind, bin, q) -> seconds
    observations: Mapping[tuple[str, int], float] = field(default_factory=dict)  # (kind, bin) -> decayed count
    slo_max_concurrency: int | None = None  # with objectives, once known
    slo_knee_observed: bool | None = None  # None without objectives
    context_p90_tokens: float | None = None  # p90 prompt + p90 generation tokens of finished requests


def kv_bytes_per_token(
    kv_cache_memory_bytes: int | None, capacity: int | None, blocks_overridden: bool
) -> float | None:
    """Bytes of KV cache per token when vLLM was given a fixed KV budget (``kv_cache_memory_bytes``).

    Not valid when ``--num-gpu-blocks-override`` decoupled the block count from the budget.
    """
    if kv_cache_memory_bytes is None or not capacity or blocks_overridden:
        return None
    return kv_cache_memory_bytes / capacity


def accumulate_counter(total: float | None, previous_raw: float | None, raw: float, restarted: bool) -> float:
    """Carry a vLLM counter across vLLM restarts so that it never decreases (no negative rates).

    ``total`` is the value exported so far, ``previous_raw`` vLLM's last reading. A counter that went down, or any
    reading after a detected restart, is a reset: its whole value is new increase.
    """
    if total is None or previous_raw is None:
        return raw
    if restarted or raw < previous_raw:
        return total + raw
    return total + (raw - previous_raw)


@dataclass(frozen=True)
class EngineCapacity:
    """Everything derived for one engine. ``None`` = cannot be known from what vLLM reported."""

    model_name: str
    engine: str
    max_model_len: int | None
    usage_ratio: float | None
    blocks: int | None
    block_size: int | None
    capacity_tokens: int | None
    used_tokens: float | None
    free_tokens: float | None
    max_concurrency: float | None
    mean_context_tokens: float | None
    max_concurrency_observed: float | None
    concurrency_utilization: float | None
    concurrency_utilization_observed: float | None
    running: float | None
    waiting: float | None
    waiting_for_capacity: float | None
    swapped: float | None
    kv_bytes_per_token_cache_config: float | None  # kv_cache_memory_bytes / capacity
    kv_bytes_per_token_startup_log: float | None = None  # method startup_log
    kv_bytes_per_token_model_config: float | None = None  # method model_config
    kv_pool_bytes: float | None = None
    weights_bytes: float | None = None
    cuda_graph_bytes: float | None = None
    activation_peak_bytes: float | None = None
    memory_device: str | None = None  # GPU or CPU: where vLLM's log says its KV cache lives
    preemptions_total: float | None = None  # vLLM's counter carried across its restarts (set by the agent)
    cache_info: Mapping[str, str] = field(default_factory=dict)  # vllm:cache_config_info's labels
    latency: LatencyView = field(default_factory=LatencyView)
    concurrency_utilization_slo: float | None = None
    max_concurrency_p90_context: float | None = None
    headroom_requests: float | None = None
    headroom_basis: str | None = None  # the max_concurrency basis that binds: observed_context or slo
    concurrency_limit: str | None = None  # one of LIMITS: what limits concurrency now
    waiting_deferred: float | None = None
    asleep: bool | None = None  # vLLM's sleep mode: its KV cache is freed (None: vLLM does not say)
    spec_decode: SpecDecode | None = None  # speculative decoding's acceptance, when vLLM counts it
    cpu_capacity_tokens: int | None = None  # the CPU tier: V0 swap space, V1 KV offloading
    layout: PlannedLayout | None = None  # the KV-cache groups planned from --model-config for vLLM's own budget
    lora: LoraSlots | None = None  # multi-LoRA serving: vLLM's adapter slots and the adapters using them

    def concurrency_at(self, context_tokens: int) -> float | None:
        """Max concurrency if every request held ``context_tokens`` tokens (None past max_model_len)."""
        if self.max_model_len and context_tokens > self.max_model_len:
            return None
        return max_concurrency_at_context(self.capacity_tokens, context_tokens)


@dataclass(frozen=True)
class SpecDecode:
    """Speculative decoding's acceptance since vLLM started, from its spec_decode_* counters."""

    draft_tokens: float
    accepted_tokens: float
    drafts: float | None  # V1 only

    @property
    def acceptance_ratio(self) -> float | None:
        """The share of drafted tokens the target accepted (None before the first draft)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens each verification step emits on average: the target's own and the accepted drafts (vLLM's
        "Mean acceptance length": 1 + accepted / drafts)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None


@dataclass(frozen=True)
class LoraSlots:
    """Multi-LoRA serving, from ``vllm:lora_requests_info``: the adapters one batch can hold (vLLM's --max-loras),
    those with requests in the batch, and whether requests wait for a slot that other adapters hold (None: vLLM does
    not say enough to tell)."""

    slots: int | None
    running: tuple[str, ...]
    blocked: bool | None


def lora_slots(lora: LoraRequests | None, m: EngineMetrics, engines: int, schema: str) -> LoraSlots | None:
    """The server's LoRA series for its one engine (None without LoRA, or with several engines, whose one series
    vLLM says misleads).

    What the lists say differs by engine. V0's scheduler lists the adapters of its running and of its waiting
    queue. V1 (read in 0.32, and seen on its server) tracks requests in the front end, which learns of a request
    only from the engine's outputs, once it runs; and it puts every adapter it tracks in both lists. So under V1 the
    lists name the adapters with requests in the batch, and a request waiting for a slot shows as one vLLM defers
    (``num_requests_waiting_by_reason{reason="deferred"}``) while every slot is in use. vLLM records the series only
    while it steps (0.32's last one, once idle, has empty lists), so an adapter counts only while vLLM reports
    requests running: a series left from a step that no longer is never counts."""
    if lora is None or engines != 1:
        return None
    running = () if m.running == 0 else lora.running
    full = lora.max_loras is not None and len(running) >= lora.max_loras
    blocked: bool | None
    if m.waiting == 0:
        blocked = False  # nothing waits, for a slot or anything else
    elif m.waiting is None:
        blocked = None
    elif schema == SCHEMA_V0:
        blocked = full and any(a not in running for a in lora.waiting)
    elif "deferred" in m.waiting_by_reason:
        blocked = full and m.waiting_by_reason["deferred"] > 0
    else:  # V1 before vLLM gave reasons for waiting: its lists cannot say
        blocked = None
    return LoraSlots(lora.max_loras, running, blocked)


@dataclass(frozen=True)
class PlannedLayout:
    """vLLM's KV-cache groups as the planner lays them out for this engine's own KV memory and settings: by layer
    kind, the groups and the blocks a request of max_model_len holds in them; and whether vLLM's own capacity
    agrees (within one block per group)."""

    groups: Mapping[str, int]  # layer kind -> KV-cache groups of that kind
    blocks_per_request: Mapping[str, int]  # layer kind -> blocks a max_model_len request holds in its groups
    planned_tokens: int
    mismatch: bool | None  # None: vLLM reports no token capacity to compare
    assumed: str  # the settings the plan took that vLLM does not report
    worker_bytes_per_block: int = 0  # bytes of one block on one rank, over every layer
    latent: bool = False  # an MLA model: one latent per token, which every TP rank holds alike
    kv_bytes_per_token: int = 0  # the plan's, per rank: the release's rules, a logged drafter's layers included


def planned_layout(
    geometry: Geometry | None,
    cc: CacheConfig | None,
    *,
    max_model_len: int | None,
    capacity_tokens: int | None,
    pool_bytes: float | None,
    rules: tuple[str, tuple[int, int, int]],
    tp: int,
    pp: int,
    max_num_batched_tokens: int | None,
    device: str | None,
    speculation: LiveSpeculation | None = None,
) -> PlannedLayout | None:
    """The planner's layout for vLLM's own budget (``kv_cache_memory_bytes``, else the log's KV memory), block size,
    dtype and Mamba settings; None without --model-config, a budget or max_model_len, or where the planner does not
    model the server. vLLM does not report its max_num_batched_tokens or async scheduling: the log's
    "Chunked prefill is enabled with max_num_batched_tokens=N" (else 2048) and async off only on the CPU backend.
    A speculative drafter is planned from the engine's logged config (:func:`live_speculation`); where it cannot be
    known, there is no layout rather than one that would disagree with vLLM for want of it."""
    if geometry is None or cc is None or not max_model_len or not pool_bytes or cc.block_size is None:
        return None
    if _backend_decides(geometry, cc.cache_dtype):
        return None
    spec, spec_assumed = live_speculation(speculation or LiveSpeculation())
    if spec is _UNKNOWN:
        return None
    batched = max_num_batched_tokens or 2048
    inputs = sizing.PlanInputs(
        kv_cache_memory_bytes=int(pool_bytes),
        max_model_len=max_model_len,
        tp=tp,
        pp=pp,
        kv_cache_dtype=cc.cache_dtype or "auto",
        block_size=cc.block_size,
        version=rules[1],
        engine=rules[0],
        max_num_batched_tokens=batched,
        mamba_cache_mode=cc.labels.get("mamba_cache_mode", "auto"),
        mamba_ssm_cache_dtype=cc.labels.get("mamba_ssm_cache_dtype", "auto"),
        async_scheduling=device != "CPU",
        speculation=spec if isinstance(spec, sizing.Speculation) else None,
    )
    plan = _plan(geometry, inputs)
    if plan is None:
        return None
    groups: dict[str, int] = {}
    per_request: dict[str, int] = {}
    if plan.groups:
        for g in plan.groups:
            groups[g.kind] = groups.get(g.kind, 0) + 1
            per_request[g.kind] = per_request.get(g.kind, 0) + g.blocks_per_request
    else:  # one kind of KV layer: vLLM's single group
        kind = "mla" if "mla" in geometry.layer_kinds else "full"
        groups[kind], per_request[kind] = 1, math.ceil(max_model_len / plan.block_size)
    mismatch = None
    if capacity_tokens is not None:
        mismatch = abs(capacity_tokens - plan.kv_cache_tokens) > plan.block_size * sum(groups.values())
    assumed = f"max_num_batched_tokens {batched}{'' if max_num_batched_tokens else ' (assumed)'}, async scheduling "
    assumed += "off (CPU backend)" if device == "CPU" else "on"
    assumed += spec_assumed
    if sizing.sparse_latent_assumption(geometry, inputs.kv_cache_dtype):
        assumed += ", a 16-bit latent (not an SM120 GPU's fp8_ds_mla)"
    latent = "mla" in geometry.layer_kinds
    return PlannedLayout(
        groups,
        per_request,
        plan.kv_cache_tokens,
        mismatch,
        assumed,
        plan.worker_bytes_per_block,
        latent,
        plan.kv_bytes_per_token,
    )


@dataclass(frozen=True)
class LiveSpeculation:
    """What the agent knows of the server's speculative decoding: the (method, num_speculative_tokens) vLLM's engine
    logged (None: none, or no log) and whether vLLM counts speculative drafts (its spec_decode_* counters, there
    from the start when it speculates)."""

    logged: tuple[str, int] | None = None
    counting: bool = False


_UNKNOWN = object()
_WITHOUT_LAYERS = ("ngram", "ngram_gpu", "suffix")  # drafts from the prompt: no KV layers of their own


def live_speculation(seen: LiveSpeculation) -> tuple[object, str]:
    """The drafter to plan the live layout with: a Speculation, None (no speculation) or _UNKNOWN (speculating in
    a way the agent cannot size: a separate draft model, whose config it does not have, or a method the log did not
    name); and what was assumed, for the layout's ``assumed`` text."""
    if seen.logged is None:
        return (_UNKNOWN, "") if seen.counting else (None, "")
    method, tokens = seen.logged
    if method in _WITHOUT_LAYERS:
        return sizing.Speculation("ngram", tokens), f", {method} speculation of {tokens} tokens"
    if method == "mtp" or method.endswith("_mtp"):
        return sizing.Speculation("mtp", tokens), f", MTP speculation of {tokens} tokens (the model's own layers)"
    if method in ("eagle", "eagle3"):
        return (
            sizing.Speculation(method, tokens),
            f", {method} speculation of {tokens} tokens (its head assumed one layer shaped like the model's)",
        )
    return _UNKNOWN, ""


def cpu_capacity_tokens(
    cc: CacheConfig | None,
    schema: str,
    layout: PlannedLayout | None,
    *,
    tp: int,
    pp: int,
    version: tuple[int, int, int],
) -> int | None:
    """The CPU tier in tokens: V0's swap space (cache_config_info num_cpu_blocks x block_size), or V1's native KV
    offloading (kv_offloading_size GiB, from 0.32) sized from the planned bytes per block; None when there is none
    or it cannot be sized (offloading without --model-config, another backend, a release not read, or an MLA model
    under TP alone, whose tier holds one copy or one per rank by the executor and nodes, which vLLM does not
    report)."""
    if cc is None or cc.block_size is None:
        return None
    if schema == SCHEMA_V0:
        return cc.num_cpu_blocks * cc.block_size if cc.num_cpu_blocks is not None else None
    gib = cc.kv_offloading_size_gib
    if gib is None or layout is None or cc.labels.get("kv_offloading_backend", "native") != "native":
        return None
    if sizing.latent_shared_by_ranks(mla=layout.latent, tp=tp, pp=pp):
        return None
    try:
        return sizing.cpu_tier_tokens(
            offloading_bytes=int(gib * (1 << 30)),
            worker_bytes_per_block=layout.worker_bytes_per_block,
            world_size=tp * pp,
            block_size=cc.block_size,
            version=version,
        )
    except ValueError:  # a release whose tier was not read (NotModelled), or a size below zero
        return None


@functools.lru_cache(maxsize=64)
def _plan(geometry: Geometry, inputs: sizing.PlanInputs) -> sizing.KvPlan | None:
    """One plan per distinct server setting (the scrape loop asks every cycle); None where the planner refuses."""
    try:
        return sizing.plan(geometry, inputs)
    except ValueError:  # NotModelled, ImpossiblePlan, a dtype it does not know: no layout, never a wrong one
        return None


def spec_decode(m: EngineMetrics) -> SpecDecode | None:
    """The engine's acceptance figures; None when it does not decode speculatively (no counters)."""
    if m.spec_draft_tokens_total is None or m.spec_accepted_tokens_total is None:
        return None
    return SpecDecode(m.spec_draft_tokens_total, m.spec_accepted_tokens_total, m.spec_drafts_total)


def model_kv_bytes_per_token(geometry: Geometry | None, cache_dtype: str | None, tp: int, pp: int) -> float | None:
    """Bytes per token per GPU rank from the model's geometry; None where the planner does not model it."""
    if geometry is None or not geometry.uniform or geometry.unmodelled_cache or _backend_decides(geometry, cache_dtype):
        return None
    try:
        dtype_bytes = sizing.kv_dtype_bytes(cache_dtype or "auto", geometry.dtype)
        geometry = sizing.packed_rows(geometry, cache_dtype or "auto")
    except ValueError:
        return None
    layers = sizing.layers_per_rank(geometry.kv_layers, pp)
    return sizing.bytes_per_token_per_layer(geometry, tp, dtype_bytes) * layers


def _backend_decides(geometry: Geometry, cache_dtype: str | None) -> bool:
    """A sparse-attention model under an fp8 dtype: its latent is plain fp8 or the packed fp8_ds_mla by the GPU's
    attention backend, which vLLM does not report (the plan assumes, and says; the live agent gives no figure)."""
    name = (cache_dtype or "auto").lower()
    return sizing.sparse_latent_assumption(geometry, name) is not None and name != "auto"


def planned_bytes_per_token(
    geometry: Geometry | None, cc: CacheConfig | None, tp: int, pp: int, layout: PlannedLayout | None
) -> float | None:
    """The model's bytes per token per rank: the planned layout's where there is one (it knows the release's rules
    and the drafter the engine logged, whose layers share the pool), else the geometry's alone."""
    alone = model_kv_bytes_per_token(geometry, cc.cache_dtype if cc else None, tp, pp)
    if alone is None or layout is None or not layout.kv_bytes_per_token:
        return alone
    return layout.kv_bytes_per_token


def derive_engine(
    m: EngineMetrics,
    *,
    schema: str,
    dp_engines: int,
    max_model_len: int | None,
    startup: EngineFigures | None = None,
    geometry: Geometry | None = None,
    tp: int = 1,
    pp: int = 1,
    rules: tuple[str, tuple[int, int, int]] | None = None,
    preemptions_total: float | None = None,
    latency: LatencyView | None = None,
    preempted: bool = False,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    speculation: tuple[str, int] | None = None,
    lora: LoraSlots | None = None,
) -> EngineCapacity:
    """One engine's figures. ``rules``: the engine and release whose sizing rules apply (:func:`sizing_rules`;
    None: the metric generation's); ``preemptions_total``: vLLM's counter as the agent carries it over restarts."""
    cc = m.cache_config
    block_size = cc.block_size if cc else None
    rules = rules or sizing_rules(schema, None)
    blocks, cap, max_conc = _cache_size(m, schema, dp_engines, max_model_len, startup, rules)
    used = used_tokens(m.kv_cache_usage, cap)
    overridden = cc is not None and cc.num_gpu_blocks_override is not None
    pool = startup.kv_pool_bytes if startup is not None else None
    if pool is None and cc is not None and not overridden:
        pool = cc.kv_cache_memory_bytes
    mean_ctx = mean_context_tokens(used, m.running)
    max_conc_obs = max_concurrency_at_context(cap, mean_ctx)
    latency = latency or LatencyView()
    slo = latency.slo_max_concurrency
    room, binding = headroom(m.running, {"observed_context": max_conc_obs, "slo": slo})
    limit = concurrency_limit(
        running=m.running,
        waiting=m.waiting,
        waiting_for_capacity=m.waiting_for_capacity,
        preempted=preempted,
        usage=m.kv_cache_usage,
        max_num_seqs=max_num_seqs,
        slo_max_concurrency=slo,
        lora_blocked=bool(lora and lora.blocked),
    )
    asleep = None if m.sleep_state is None else m.sleep_state != "awake"
    layout = planned_layout(
        geometry,
        cc,
        max_model_len=max_model_len,
        capacity_tokens=None if overridden else cap,  # blocks forced by an override: nothing to compare
        pool_bytes=cc.kv_cache_memory_bytes if cc and not overridden and cc.kv_cache_memory_bytes else pool,
        rules=rules,
        tp=tp,
        pp=pp,
        max_num_batched_tokens=max_num_batched_tokens,
        device=startup.device if startup is not None else None,
        speculation=LiveSpeculation(speculation, counting=m.spec_draft_tokens_total is not None),
    )
    if asleep:  # sleep mode freed the KV cache: none of it is there to serve, and no limit or headroom applies
        limit, room, binding = None, None, None
    return EngineCapacity(
        max_concurrency_p90_context=max_concurrency_at_context(cap, latency.context_p90_tokens),
        asleep=asleep,
        concurrency_limit=limit,
        waiting_deferred=m.waiting_by_reason.get("deferred"),
        latency=latency,
        concurrency_utilization_slo=concurrency_utilization(m.running, slo),
        headroom_requests=room,
        headroom_basis=binding,
        model_name=m.model_name,
        engine=m.engine,
        preemptions_total=preemptions_total,
        max_model_len=max_model_len,
        usage_ratio=m.kv_cache_usage,
        blocks=blocks,
        block_size=block_size,
        capacity_tokens=cap,
        used_tokens=used,
        free_tokens=0.0 if asleep and cap is not None else free_tokens(cap, used),
        max_concurrency=max_conc,
        mean_context_tokens=mean_ctx,
        max_concurrency_observed=max_conc_obs,
        concurrency_utilization=concurrency_utilization(m.running, max_conc),
        concurrency_utilization_observed=concurrency_utilization(m.running, max_conc_obs),
        running=m.running,
        waiting=m.waiting,
        waiting_for_capacity=m.waiting_for_capacity,
        swapped=m.swapped,
        kv_bytes_per_token_cache_config=kv_bytes_per_token(cc.kv_cache_memory_bytes if cc else None, cap, overridden),
        kv_bytes_per_token_startup_log=startup.kv_bytes_per_token if startup is not None else None,
        kv_bytes_per_token_model_config=planned_bytes_per_token(geometry, cc, tp, pp, layout),
        kv_pool_bytes=pool,
        weights_bytes=startup.weights_bytes if startup is not None else None,
        cuda_graph_bytes=startup.cuda_graph_bytes if startup is not None else None,
        activation_peak_bytes=startup.activation_peak_bytes if startup is not None else None,
        memory_device=startup.device if startup is not None else None,
        cache_info=dict(cc.labels) if cc else {},
        spec_decode=spec_decode(m),
        layout=layout,
        cpu_capacity_tokens=cpu_capacity_tokens(cc, schema, layout, tp=tp, pp=pp, version=rules[1]),
        lora=lora,
    )


def _cache_size(
    m: EngineMetrics,
    schema: str,
    dp_engines: int,
    max_model_len: int | None,
    startup: EngineFigures | None,
    rules: tuple[str, tuple[int, int, int]],
) -> tuple[int | None, int | None, float | None]:
    """The engine's blocks, capacity in tokens and maximum concurrency at max_model_len: from vLLM's metrics,
    else from its startup log (V1 0.8.x reports no block count)."""
    cc = m.cache_config
    block_size = cc.block_size if cc else None
    blocks = blocks_per_engine(cc.num_gpu_blocks if cc else None, dp_engines, schema)
    if blocks is None and startup is not None:
        blocks = startup.num_gpu_blocks
    cap = capacity_tokens(cc.kv_cache_size_tokens if cc else None, blocks, block_size)
    if cap is None and startup is not None:
        cap = startup.kv_cache_tokens  # V1 0.8.x: only the log says it
    engine, rules_version = rules
    max_conc = max_concurrency_at_max_model_len(
        reported=cc.kv_cache_max_concurrency if cc else None,
        blocks=blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        engine=engine,
        version=rules_version,
    )
    if max_conc is None and startup is not None and startup.max_model_len == max_model_len:
        max_conc = startup.max_concurrency
    return blocks, cap, max_conc


def max_model_len_from_cache_config(m: EngineMetrics) -> int | None:
    """vLLM >= 0.24: kv_cache_size_tokens = int(max_concurrency x max_model_len), so their ratio is max_model_len."""
    cc = m.cache_config
    if cc is None or not cc.kv_cache_size_tokens or not cc.kv_cache_max_concurrency:
        return None
    return round(cc.kv_cache_size_tokens / cc.kv_cache_max_concurrency)


def derive_all(
    metrics: VllmMetrics,
    max_model_len: dict[str, int],
    fallback_max_model_len: int | None,
    *,
    startup: dict[str, EngineFigures] | None = None,
    geometry: Geometry | None = None,
    tp: int = 1,
    pp: int = 1,
    version: str | None = None,
    preemptions: Mapping[tuple[str, str], float] | None = None,
    latency: Mapping[tuple[str, str], LatencyView] | None = None,
    preempted: frozenset[tuple[str, str]] = frozenset(),
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    speculation: tuple[str, int] | None = None,
) -> list[EngineCapacity]:
    """Derive every engine. ``max_model_len`` maps model_name -> value from /v1/models; ``startup`` engine -> its
    startup-log figures; ``version`` is vLLM's /version (its sizing rules; None: those of the metric generation);
    ``preemptions`` (model_name, engine) -> the preemption counter the agent carries."""
    out = []
    rules = sizing_rules(metrics.schema, version)  # once a scrape, not once an engine
    for m in metrics.engines:
        figures = (startup or {}).get(m.engine)
        mml = max_model_len.get(m.model_name)
        if mml is None and len(max_model_len) == 1:
            mml = next(iter(max_model_len.values()))  # one base model served under another name
        if mml is None:
            mml = (
                fallback_max_model_len
                or max_model_len_from_cache_config(m)
                or (figures.max_model_len if figures is not None else None)
            )
        out.append(
            derive_engine(
                m,
                schema=metrics.schema,
                dp_engines=metrics.dp_engines,
                max_model_len=mml,
                startup=figures,
                geometry=geometry,
                tp=tp,
                pp=pp,
                rules=rules,
                preemptions_total=(preemptions or {}).get((m.model_name, m.engine)),
                latency=(latency or {}).get((m.model_name, m.engine)),
                preempted=(m.model_name, m.engine) in preempted,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                speculation=speculation,
                lora=lora_slots(metrics.lora, m, len(metrics.engines), metrics.schema),
            )
        )
    return out
