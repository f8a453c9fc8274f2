"""An engine's max_model_len, the longest request it accepts: /v1/models', else the operator's flag, else what
cache_config_info or the start-up log imply; and what a context figure may be against it."""

from __future__ import annotations

from vllm_capacity.derive.facts import ServerFacts
from vllm_capacity.sources.vllm_log import EngineFigures
from vllm_capacity.sources.vllm_metrics.records import EngineMetrics

#: the longest context any figure may give: vLLM's max_model_len is a 32-bit int in its configs and kernels
MOST_TOKENS = 2**31 - 1


def at_most(value: float | None, bound: int | None) -> float | None:
    return value if value is None or bound is None else min(value, bound)


def max_model_len_from_cache_config(m: EngineMetrics) -> int | None:
    """vLLM >= 0.24: kv_cache_size_tokens = int(max_concurrency x max_model_len), so their ratio is max_model_len."""
    cc = m.cache_config
    if cc is None or not cc.kv_cache_size_tokens or not cc.kv_cache_max_concurrency:
        return None
    return round(cc.kv_cache_size_tokens / cc.kv_cache_max_concurrency)


def resolve_max_model_len(m: EngineMetrics, facts: ServerFacts, figures: EngineFigures | None) -> int | None:
    """The engine's max_model_len: /v1/models' for its model (or the one model it serves under another name), else
    --max-model-len, else what cache_config_info or the start-up log imply."""
    mml = facts.max_model_len.get(m.model_name)
    if mml is None and len(facts.max_model_len) == 1:
        mml = next(iter(facts.max_model_len.values()))  # one base model served under another name
    if mml is None:
        mml = (
            facts.flags.max_model_len
            or max_model_len_from_cache_config(m)
            or (figures.max_model_len if figures is not None else None)
        )
    return mml if mml is None or mml <= MOST_TOKENS else None  # a context past 2^31 - 1 tokens cannot be right
