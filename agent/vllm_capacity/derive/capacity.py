"""The per-engine capacity formulas: plain functions over plain data, no I/O.

Every formula here follows where vLLM defines it (``vllm/v1/core/kv_cache_utils.py``, ``vllm/v1/metrics/loggers.py``;
the formulas are tabled in ``docs/metrics.md``). A value that cannot be known is ``None``, never 0: the exposition
drops ``None`` series instead of exporting a wrong number. Every per-engine formula sits
beside the others, each a few lines, with the table below as their index.

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
``max_concurrency{basis="sustained"}``
    The running requests at the reads where requests waited for capacity or vLLM preempted, a decayed mean
    (``features.learn_sustained``): what vLLM holds under pressure, whatever limits it.
``headroom_requests``
    While requests wait for capacity: ``-waiting`` (basis ``queue``); after a preemption: ``min(model, 0)``
    (basis ``preemption``); else the smallest of the bounds (observed context, SLO, sustained) ``- running``.
``kv_bytes_per_token``, three ways (per GPU rank):
    ``cache_config``: ``kv_cache_memory_bytes / capacity`` when vLLM was given a fixed KV budget;
    ``startup_log``: 'Available KV cache memory' / 'KV cache size' tokens from vLLM's log;
    ``model_config``: ``2 x layers per rank x max(1, kv_heads // tp) x head_dim x kv dtype bytes`` (MLA: 1 x latent).

When /metrics lacks them (V1 0.8.x reports ``num_gpu_blocks="None"``), capacity, max concurrency and
max_model_len come from the startup log.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_capacity import sizing
from vllm_capacity.sources.vllm_metrics.records import SCHEMA_V0, SCHEMA_V1, SCHEMA_V1_CAPACITY, SCHEMA_V1_LEGACY


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


def sizing_rules(schema: str, version: str | None) -> sizing.SizingRules:
    """The engine (v0, v1) and the release whose sizing rules apply: vLLM's /version when it answered, else the
    oldest release of the metric generation it serves."""
    engine_version: sizing.EngineVersion = "v0" if schema == SCHEMA_V0 else "v1"
    if version:
        with contextlib.suppress(ValueError):
            return sizing.SizingRules(engine_version, sizing.parse_version(version))
    return sizing.SizingRules(engine_version, GENERATION_OLDEST.get(schema, GENERATION_OLDEST[SCHEMA_V1]))


def max_concurrency_at_max_model_len(
    *,
    reported: float | None,
    blocks: int | None,
    block_size: int | None,
    max_model_len: int | None,
    rules: sizing.SizingRules,
) -> float | None:
    """Requests of exactly ``max_model_len`` tokens that fit in the KV cache ("Maximum concurrency ... 6.37x"):
    vLLM's own figure when it reports one, else its formula under ``rules``."""
    if reported is not None:
        return reported
    if blocks is None or block_size is None or not max_model_len or block_size <= 0:
        return None
    return sizing.max_concurrency(
        blocks, block_size, max_model_len, engine_version=rules.engine_version, version=rules.release
    )


def mean_context_tokens(used: float | None, running: float | None) -> float | None:
    """Average KV tokens per running request; unknown while nothing runs, for a fraction of a request (vLLM counts
    whole ones: running 0.001 made a mean of 2.1 M tokens in a cache of 4,096), and when it comes out under one token
    (a running request holds at least a block: a usage that small, or none, is below vLLM's resolution, a denormal
    number, or a cache of 0 tokens)."""
    if used is None or running is None or running < 1:
        return None
    mean = used / running
    return None if mean < 1 or not math.isfinite(mean) else mean


def max_concurrency_at_context(capacity: int | None, context_tokens: float | None) -> float | None:
    """How many requests of ``context_tokens`` each fit in ``capacity`` tokens (none of under a token)."""
    if capacity is None or not context_tokens or context_tokens < 1:
        return None
    return capacity / context_tokens


def concurrency_utilization(running: float | None, max_concurrency: float | None) -> float | None:
    """running / max_concurrency; None when the bound is unknown or so small that the ratio is not a number."""
    if running is None or not max_concurrency or max_concurrency <= 0:
        return None
    ratio = running / max_concurrency
    return ratio if math.isfinite(ratio) else None


def headroom(
    running: float | None,
    bounds: Mapping[str, float | None],
    *,
    queue: float | None = None,
    preempted: bool = False,
    shedding: bool = False,
) -> tuple[float | None, str | None]:
    """Requests this engine can still take, and why (the basis). vLLM's own evidence first: while ``queue``
    requests wait for capacity the engine has none, whatever a model of it says: minus the queue, basis ``queue``;
    while its queue caps reject requests (``shedding``), or after a preemption, at most zero, basis ``queue_cap`` or
    ``preemption``. A calm engine: the smallest known max concurrency (by basis) minus running, and the basis that
    binds. (None, None) when running is unknown or nothing bounds it."""
    if running is None:
        return None, None
    if queue is not None and queue > 0:
        return -queue, "queue"
    known = {basis: v for basis, v in bounds.items() if v is not None}
    model = min(known.values()) - running if known else None
    if shedding:
        return min(model, 0.0) if model is not None else 0.0, "queue_cap"
    if preempted:
        return min(model, 0.0) if model is not None else 0.0, "preemption"
    if model is None:
        return None, None
    return model, min(known, key=lambda b: known[b])


# concurrency_limit's values, in the order they are tried (lora_slots only where vLLM serves LoRA)
LIMITS = ("queue_cap", "kv_cache", "max_num_seqs", "lora_slots", "token_budget", "slo", "none")
BUDGET_FILL_BINDS = 0.75  # the steps' mean size, as a share of the token budget, that names it


@dataclass(frozen=True)
class Bounds:
    """The limits the agent knows of beside the KV cache, for :func:`concurrency_limit`."""

    max_num_seqs: int | None = None  # --max-num-seqs (or the log's)
    slo_max_concurrency: int | None = None  # what the latency objectives allow
    lora_blocked: bool = False  # requests for an adapter wait while the --max-loras slots hold others
    budget_fill: float | None = None  # the steps' mean size over the last window / --max-num-batched-tokens
    shedding: bool = False  # vLLM's queue caps rejected requests since the last read: demand shed at the door


def concurrency_limit(
    *,
    running: float | None,
    waiting: float | None,
    waiting_for_capacity: float | None,
    preempted: bool,
    usage: float | None,
    bounds: Bounds = Bounds(),
) -> str | None:
    """What limits concurrency now: ``queue_cap`` (vLLM's --max-num-queued-reqs or --max-num-queued-tokens rejected
    requests since the last read: they are not waiting, they are gone), ``kv_cache`` (requests were preempted since
    the last read, or requests wait on
    a nearly full cache), ``max_num_seqs`` (running at vLLM's --max-num-seqs), ``lora_slots`` (requests for an
    adapter wait while vLLM's --max-loras slots hold others), ``token_budget`` (requests wait for capacity while
    the engine's steps are nearly as large as --max-num-batched-tokens allows: ``budget_fill``, their mean size
    over it), ``slo`` (running above the SLO-bound concurrency),
    ``none`` (nothing waits). None when requests wait for a reason none of these names: vLLM counts a
    request as waiting for "capacity" for any scheduling limit (a batch slot, the step's token budget), so that
    reason alone, on a cache with room, does not name the KV cache (measured on vLLM 0.32)."""
    b = bounds
    if (vllms := _vllms_evidence(b, running=running, waiting=waiting, preempted=preempted, usage=usage)) is not None:
        return vllms
    if b.lora_blocked:
        return "lora_slots"
    queue = waiting_for_capacity if waiting_for_capacity is not None else waiting
    if (queue or 0) > 0 and b.budget_fill is not None and b.budget_fill >= BUDGET_FILL_BINDS:
        return "token_budget"
    if b.slo_max_concurrency is not None and running is not None and running > b.slo_max_concurrency:
        return "slo"
    if waiting is not None and waiting == 0:
        return "none"
    return None


def _vllms_evidence(
    b: Bounds, *, running: float | None, waiting: float | None, preempted: bool, usage: float | None
) -> str | None:
    """The limits vLLM's own counters and gauges name: requests shed at the door, preempted, at --max-num-seqs, or
    waiting on a nearly full cache."""
    if b.shedding:
        return "queue_cap"
    if preempted:
        return "kv_cache"
    if b.max_num_seqs is not None and running is not None and running >= b.max_num_seqs:
        return "max_num_seqs"
    if (waiting or 0) > 0 and usage is not None and usage >= NEARLY_FULL:
        return "kv_cache"
    return None


NEARLY_FULL = 0.9  # usage at which a queue is taken for one waiting on the cache when vLLM does not say


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


#: the most one engine's counter of requests or events (preemptions, rejections, requests timed to their first
#: token) may rise in a second: far above what any engine serves (thousands a second at most); and of tokens
MAX_EVENTS_PER_SECOND = 100_000.0
MAX_TOKENS_PER_SECOND = 10_000_000.0
RISE_SLACK = 1_000.0  # what a first read, a clock's step or a read's own length may add


def plausible_rise(rise: float, seconds: float, per_second: float = MAX_EVENTS_PER_SECOND) -> bool:
    """Whether a counter's rise over ``seconds`` can be right: one read of 9e15 preemptions stayed in the carried
    counter for good, one TTFT histogram jump of 1e12 set every quantile to 2,560 s."""
    return math.isfinite(rise) and rise <= per_second * max(seconds, 0.0) + RISE_SLACK
