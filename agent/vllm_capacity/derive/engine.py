"""One engine's figures, all of them (:class:`EngineCapacity`), and every engine of a scrape: the capacity
formulas, the features and the planned layout put together."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_capacity import sizing
from vllm_capacity.derive.capacity import (
    Bounds,
    blocks_per_engine,
    capacity_tokens,
    concurrency_limit,
    concurrency_utilization,
    free_tokens,
    headroom,
    kv_bytes_per_token,
    max_concurrency_at_context,
    max_concurrency_at_max_model_len,
    mean_context_tokens,
    sizing_rules,
    used_tokens,
)
from vllm_capacity.derive.context import at_most, resolve_max_model_len
from vllm_capacity.derive.facts import NO_FACTS, NO_HISTORY, EngineHistory, ServerFacts
from vllm_capacity.derive.features import (
    NO_SUSTAINED,
    LatencyView,
    LoraSlots,
    SpecDecode,
    Sustained,
    budget_fill,
    lora_slots,
    spec_decode,
)
from vllm_capacity.derive.layout import (
    EnginePool,
    PlannedLayout,
    cpu_capacity_tokens,
    planned_bytes_per_token,
    planned_layout,
)
from vllm_capacity.sources.vllm_log import EngineFigures
from vllm_capacity.sources.vllm_metrics.records import CacheConfig, EngineMetrics, VllmMetrics


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
    #: how vLLM's log says it sized the cache: 0.34's extensible cache after warm-up, within the budget it requested
    #: (None: the estimate before warm-up, every release before 0.34), a remap from warm-up's blocks, a host tier
    kv_sized_after_warmup: bool | None = None
    kv_requested_budget_bytes: float | None = None
    kv_remapped_from_blocks: int | None = None
    kv_host_tier: bool = False
    preemptions_total: float | None = None  # vLLM's counter carried across its restarts (set by the agent)
    cache_info: Mapping[str, str] = field(default_factory=dict)  # vllm:cache_config_info's labels
    latency: LatencyView = field(default_factory=LatencyView)
    concurrency_utilization_slo: float | None = None
    max_concurrency_p90_context: float | None = None
    headroom_requests: float | None = None
    headroom_basis: str | None = None  # queue_cap, queue, preemption, or the max_concurrency basis that binds
    shedding: bool | None = None  # the model's queue caps rejected requests since the last read (None: not reported)
    sustained: Sustained | None = None  # the concurrency vLLM holds under pressure (None: nothing ran yet)
    concurrency_utilization_sustained: float | None = None
    token_budget_fill_ratio: float | None = None  # the steps' mean size / --max-num-batched-tokens, last window
    concurrency_limit: str | None = None  # one of LIMITS: what limits concurrency now
    waiting_deferred: float | None = None
    asleep: bool | None = None  # vLLM's sleep mode: its KV cache is freed (None: vLLM does not say)
    spec_decode: SpecDecode | None = None  # speculative decoding's acceptance, when vLLM counts it
    cpu_capacity_tokens: int | None = None  # the CPU tier: V0 swap space, V1 KV offloading (vLLM's figure wins)
    cpu_capacity_tokens_planned: int | None = None  # the plan's figure of it, from kv_offloading_size
    cpu_capacity_reported: bool = False  # cpu_capacity_tokens is vLLM's own (kv_offload_config_info, ...)
    cpu_used_tokens: float | None = None  # the tier's tokens in use, where vLLM reports them
    layout: PlannedLayout | None = None  # the KV-cache groups planned from --model-config for vLLM's own budget
    lora: LoraSlots | None = None  # multi-LoRA serving: vLLM's adapter slots and the adapters using them

    def concurrency_at(self, context_tokens: int) -> float | None:
        """Max concurrency if every request held ``context_tokens`` tokens (None past max_model_len)."""
        if self.max_model_len and context_tokens > self.max_model_len:
            return None
        return max_concurrency_at_context(self.capacity_tokens, context_tokens)


@dataclass(frozen=True)
class EngineInputs:
    """One engine's share of the facts and history, resolved: its metric generation and data-parallel engines,
    max_model_len, start-up figures, the sizing rules that apply, and what the agent learned of it."""

    schema: str
    dp_engines: int = 1
    max_model_len: int | None = None
    startup: EngineFigures | None = None
    rules: sizing.SizingRules | None = None  # sizing_rules of the server's version; None: the metric generation's
    preemptions_total: float | None = None  # vLLM's counter as the agent carries it over restarts
    latency: LatencyView = field(default_factory=LatencyView)
    preempted: bool = False
    lora: LoraSlots | None = None
    sustained: Sustained = NO_SUSTAINED
    shedding: bool | None = None  # the model's queue caps rejected requests since the last read (None: not reported)


def derive_engine(m: EngineMetrics, inputs: EngineInputs, facts: ServerFacts = NO_FACTS) -> EngineCapacity:
    """One engine's figures from its metrics, its resolved inputs and what the agent knows of the server."""
    cc = m.cache_config
    rules = inputs.rules or sizing_rules(inputs.schema, None)
    blocks, cap, max_conc = _cache_size(m, inputs, rules)
    used = used_tokens(m.kv_cache_usage, cap)
    overridden = cc is not None and cc.num_gpu_blocks_override is not None
    startup, pool, blocks_bytes = _pool(cc, inputs.startup, overridden)
    mean_ctx = mean_context_tokens(used, m.running)
    max_conc_obs = max_concurrency_at_context(cap, mean_ctx)
    reported = EnginePool(
        max_model_len=inputs.max_model_len,
        pool_bytes=cc.kv_cache_memory_bytes if cc and not overridden and cc.kv_cache_memory_bytes else blocks_bytes,
        capacity_tokens=None if overridden else cap,  # blocks forced by an override: nothing to compare
        device=startup.device if startup is not None else None,
        counting=m.spec_draft_tokens_total is not None,
    )
    layout = planned_layout(cc, facts, reported, rules)
    return EngineCapacity(
        model_name=m.model_name,
        engine=m.engine,
        max_model_len=inputs.max_model_len,
        usage_ratio=m.kv_cache_usage,
        blocks=blocks,
        block_size=cc.block_size if cc else None,
        capacity_tokens=cap,
        used_tokens=used,
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
        kv_bytes_per_token_model_config=planned_bytes_per_token(facts.model, cc, layout),
        kv_pool_bytes=pool,
        preemptions_total=inputs.preemptions_total,
        cache_info=dict(cc.labels) if cc else {},
        spec_decode=spec_decode(m),
        layout=layout,
        **_cpu_tier(
            m,
            cpu_capacity_tokens(cc, inputs.schema, layout, tp=facts.model.tp, pp=facts.model.pp, version=rules.release),
        ),
        lora=inputs.lora,
        **_startup_fields(startup),
        **_load_fields(m, inputs, facts, cap=cap, used=used, max_conc_obs=max_conc_obs),
    )


def _pool(
    cc: CacheConfig | None, startup: EngineFigures | None, overridden: bool
) -> tuple[EngineFigures | None, float | None, float | None]:
    """The start-up figures that hold for this cache, the KV pool's bytes, and the bytes vLLM's block arithmetic
    divides: from the start-up log, else from the cache config (unless its blocks were forced by an override)."""
    if startup is not None and cc is not None and cc.extensible_kv_cache and not startup.extensible:
        # 0.34 sized the cache after warm-up and the log read has no post-warm-up line (yet): its "Available KV cache
        # memory" is the estimate before warm-up, never the pool; the log's other figures (weights) stand
        startup = replace(startup, kv_cache_memory_bytes=None)
    pool = startup.kv_pool_bytes if startup is not None else None
    blocks_bytes = startup.kv_blocks_bytes if startup is not None else None
    if pool is None and cc is not None and not overridden:
        pool = blocks_bytes = cc.kv_cache_memory_bytes
    return startup, pool, blocks_bytes


def _cpu_tier(m: EngineMetrics, planned: int | None) -> dict[str, Any]:
    """The CPU tier in tokens: vLLM's own figure where it reports one (native offloading's
    cpu_kv_cache_size_tokens, or SimpleCPUOffloadConnector's capacity_blocks x block_size), else the plan's; the
    tokens of it in use where vLLM reports them (the simple connector's pinned blocks)."""
    block_size = m.cache_config.block_size if m.cache_config else None
    reported: float | None = m.offload_tokens
    if reported is None and m.simple_offload_blocks is not None and block_size:
        reported = m.simple_offload_blocks * block_size
    used = None
    if m.simple_offload_used_blocks is not None and block_size:
        used = m.simple_offload_used_blocks * block_size
    return {
        "cpu_capacity_tokens": int(reported) if reported is not None else planned,
        "cpu_capacity_tokens_planned": planned,
        "cpu_capacity_reported": reported is not None,
        "cpu_used_tokens": used,
    }


def _startup_fields(startup: EngineFigures | None) -> dict[str, Any]:
    """What the start-up log says of the engine's memory."""
    if startup is None:
        return {}
    return {
        "kv_bytes_per_token_startup_log": startup.kv_bytes_per_token,
        "weights_bytes": startup.weights_bytes,
        "cuda_graph_bytes": startup.cuda_graph_bytes,
        "activation_peak_bytes": startup.activation_peak_bytes,
        "memory_device": startup.device,
        "kv_sized_after_warmup": startup.extensible or None,
        "kv_requested_budget_bytes": startup.requested_bytes,
        "kv_remapped_from_blocks": startup.remapped_from_blocks,
        "kv_host_tier": startup.host_tier,
    }


def _load_fields(
    m: EngineMetrics,
    inputs: EngineInputs,
    facts: ServerFacts,
    *,
    cap: int | None,
    used: float | None,
    max_conc_obs: float | None,
) -> dict[str, Any]:
    """The engine under its load: free tokens, the SLO and context bounds, headroom, what limits concurrency, and
    sleep mode (which frees the KV cache: nothing of it to serve, no limit or headroom)."""
    latency = inputs.latency
    slo = latency.slo_max_concurrency
    fill = budget_fill(latency.step_tokens, latency.step_tokens_sum, facts.flags.max_num_batched_tokens)
    sustained = inputs.sustained
    bounds = {
        "observed_context": max_conc_obs,
        "slo": slo,
        "sustained": sustained.level if sustained.observed else None,
    }
    queue = m.waiting_for_capacity if m.waiting_for_capacity is not None else m.waiting  # V0 gives no reasons
    shedding = bool(inputs.shedding)
    room, binding = headroom(m.running, bounds, queue=queue, preempted=inputs.preempted, shedding=shedding)
    limit = concurrency_limit(
        running=m.running,
        waiting=m.waiting,
        waiting_for_capacity=m.waiting_for_capacity,
        preempted=inputs.preempted,
        usage=m.kv_cache_usage,
        bounds=Bounds(facts.flags.max_num_seqs, slo, bool(inputs.lora and inputs.lora.blocked), fill, shedding),
    )
    asleep = None if m.sleep_state is None else m.sleep_state != "awake"
    if asleep:
        limit, room, binding = None, None, None
    return {
        "free_tokens": 0.0 if asleep and cap is not None else free_tokens(cap, used),
        # no request is longer than max_model_len: a p90 interpolated past it inside vLLM's last bucket is taken as it
        "max_concurrency_p90_context": max_concurrency_at_context(
            cap, at_most(latency.context_p90_tokens, inputs.max_model_len)
        ),
        "asleep": asleep,
        "concurrency_limit": limit,
        "waiting_deferred": m.waiting_by_reason.get("deferred"),
        "latency": latency,
        "concurrency_utilization_slo": concurrency_utilization(m.running, slo),
        "headroom_requests": room,
        "headroom_basis": binding,
        "sustained": sustained if sustained.level is not None else None,
        "concurrency_utilization_sustained": concurrency_utilization(m.running, sustained.level),
        "token_budget_fill_ratio": fill,
        "shedding": inputs.shedding,
    }


def _cache_size(
    m: EngineMetrics, inputs: EngineInputs, rules: sizing.SizingRules
) -> tuple[int | None, int | None, float | None]:
    """The engine's blocks, capacity in tokens and maximum concurrency at max_model_len: from vLLM's metrics,
    else from its startup log (V1 0.8.x reports no block count)."""
    cc, startup, max_model_len = m.cache_config, inputs.startup, inputs.max_model_len
    block_size = cc.block_size if cc else None
    blocks = blocks_per_engine(cc.num_gpu_blocks if cc else None, inputs.dp_engines, inputs.schema)
    if blocks is None and startup is not None:
        blocks = startup.num_gpu_blocks
    cap = capacity_tokens(cc.kv_cache_size_tokens if cc else None, blocks, block_size)
    if cap is None and startup is not None:
        cap = startup.kv_cache_tokens  # V1 0.8.x: only the log says it
    max_conc = max_concurrency_at_max_model_len(
        reported=cc.kv_cache_max_concurrency if cc else None,
        blocks=blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        rules=rules,
    )
    if max_conc is None and startup is not None and startup.max_model_len == max_model_len:
        max_conc = startup.max_concurrency
    return blocks, cap, max_conc


def derive_all(
    metrics: VllmMetrics, facts: ServerFacts = NO_FACTS, history: EngineHistory = NO_HISTORY
) -> list[EngineCapacity]:
    """Derive every engine of a scrape, with what the agent knows of the server and learned of each engine."""
    return [derive_engine(m, inputs, facts) for m, inputs in engine_inputs(metrics, facts, history)]


def engine_inputs(
    metrics: VllmMetrics, facts: ServerFacts = NO_FACTS, history: EngineHistory = NO_HISTORY
) -> list[tuple[EngineMetrics, EngineInputs]]:
    """Each engine of a scrape with its resolved inputs: with ``facts``, all that :func:`derive_engine` reads."""
    rules = sizing_rules(metrics.schema, facts.version)  # once a scrape, not once an engine
    out = []
    for m in metrics.engines:
        key = (m.model_name, m.engine)
        figures = facts.startup.get(m.engine)
        inputs = EngineInputs(
            schema=metrics.schema,
            dp_engines=metrics.dp_engines,
            max_model_len=resolve_max_model_len(m, facts, figures),
            startup=figures,
            rules=rules,
            preemptions_total=history.preemptions.get(key),
            latency=history.latency.get(key) or LatencyView(),
            preempted=key in history.preempted,
            sustained=history.sustained.get(key, NO_SUSTAINED),
            lora=lora_slots(metrics.lora, m, len(metrics.engines), metrics.schema),
            shedding=m.model_name in history.shedding if m.model_name in history.shed_reported else None,
        )
        out.append((m, inputs))
    return out
