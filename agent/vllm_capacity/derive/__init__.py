"""Capacity derivations: plain functions over plain data, no I/O.

``capacity`` the per-engine formulas (their table is its docstring); ``features`` the records of latency, speculative
decoding and LoRA slots; ``facts`` what the derivations are given beside the metrics (``ServerFacts``,
``EngineHistory``); ``layout`` the bridge to the planner (the live KV-cache layout, the CPU tier, bytes per token
from the model); ``engine`` one engine's figures put together, and every engine of a scrape.
"""

from vllm_capacity.derive.capacity import (
    GENERATION_OLDEST,
    LIMITS,
    NEARLY_FULL,
    accumulate_counter,
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
from vllm_capacity.derive.engine import (
    EngineCapacity,
    EngineInputs,
    derive_all,
    derive_engine,
    max_model_len_from_cache_config,
)
from vllm_capacity.derive.facts import NO_FACTS, NO_HISTORY, EngineHistory, ServerFacts
from vllm_capacity.derive.features import (
    NO_SUSTAINED,
    LatencyView,
    LoraSlots,
    SpecDecode,
    Sustained,
    learn_sustained,
    lora_slots,
    spec_decode,
)
from vllm_capacity.derive.layout import (
    LiveSpeculation,
    PlannedLayout,
    cpu_capacity_tokens,
    live_speculation,
    model_kv_bytes_per_token,
    planned_bytes_per_token,
    planned_layout,
)

__all__ = [
    "GENERATION_OLDEST",
    "LIMITS",
    "NEARLY_FULL",
    "NO_FACTS",
    "NO_HISTORY",
    "NO_SUSTAINED",
    "EngineCapacity",
    "EngineHistory",
    "EngineInputs",
    "LatencyView",
    "LiveSpeculation",
    "LoraSlots",
    "PlannedLayout",
    "ServerFacts",
    "SpecDecode",
    "Sustained",
    "accumulate_counter",
    "blocks_per_engine",
    "capacity_tokens",
    "concurrency_limit",
    "concurrency_utilization",
    "cpu_capacity_tokens",
    "derive_all",
    "derive_engine",
    "free_tokens",
    "headroom",
    "kv_bytes_per_token",
    "learn_sustained",
    "live_speculation",
    "lora_slots",
    "max_concurrency_at_context",
    "max_concurrency_at_max_model_len",
    "max_model_len_from_cache_config",
    "mean_context_tokens",
    "model_kv_bytes_per_token",
    "planned_bytes_per_token",
    "planned_layout",
    "sizing_rules",
    "spec_decode",
    "used_tokens",
]
