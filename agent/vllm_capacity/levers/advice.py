"""The levers that could move a binding limit, each with vLLM's flag, the value to try and what it buys in numbers;
a lever that cannot help under the limit found is not listed (raising --max-num-seqs while the KV cache binds).

The numbers come from what the readings showed (the KV cache's capacity in tokens, the requests' length) and, for
the KV cache's data type, from the planner when the model's config.json is known (the release's own sizing rules);
without it, an fp8 cache is taken to hold twice the tokens of a 16-bit one, and said to be an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vllm_capacity import sizing
from vllm_capacity.geometry import Geometry
from vllm_capacity.levers.scale import TP_GAIN, doubled_tp_pool

SIXTEEN_BIT = ("auto", "bfloat16", "float16", "half")


@dataclass(frozen=True)
class Lever:
    """A flag in vLLM's spelling, the value to try, and its effect in words and numbers."""

    flag: str
    value: str
    effect: str


@dataclass(frozen=True)
class Situation:
    """What the levers are computed from: the limit, the KV cache as read (tokens, usage), the requests' length, and
    the server's settings where known."""

    limit: str
    concurrency: int  # the step's concurrency where the limit binds
    request_tokens: int  # prompt plus output tokens of one request
    kv_capacity_tokens: float | None = None
    kv_usage_max: float | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str | None = None  # as vLLM's cache_config_info says it ("auto": the model's)
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    geometry: Geometry | None = None  # --model-config: the planner's figures
    tp: int = 1
    version: sizing.Version | None = None
    # one GPU rank's KV pool and weights, from vLLM's start-up log (sweep --vllm-log): TP against replicas
    pool_bytes: float | None = None
    weights_bytes: float | None = None


def levers(s: Situation) -> list[Lever]:
    """The levers for ``s.limit``; none for a limit no flag moves (``none``, ``unknown``)."""
    by_limit = {
        "kv_cache": _kv_levers,
        "max_num_seqs": _seqs_levers,
        "token_budget": _budget_levers,
        "queue_cap": _queue_levers,
        "slo": _scale_levers,
        "none": _scale_levers,
    }
    found = by_limit.get(s.limit)
    return found(s) if found is not None else []


def _requests(tokens: float | None, each: int) -> str:
    return f"{tokens / each:.1f}" if tokens else "?"


def _kv_levers(s: Situation) -> list[Lever]:
    out = []
    if (s.kv_cache_dtype or "auto") in SIXTEEN_BIT:
        ratio, how = fp8_ratio(s)
        cap = s.kv_capacity_tokens
        now = (
            f"{cap:,.0f} tokens ({_requests(cap, s.request_tokens)} requests of {s.request_tokens:,})"
            if cap
            else "the pool"
        )
        then = f"{cap * ratio:,.0f} ({_requests(cap * ratio, s.request_tokens)})" if cap else f"{ratio:.2f}x"
        out.append(Lever("--kv-cache-dtype", "fp8", f"KV cache {now} -> {then} in the same memory ({how}); "
                         "fp8 KV costs some accuracy on some models: check yours"))  # fmt: skip
    if s.max_model_len and s.block_size and s.kv_capacity_tokens:
        shorter = _shorter_max_model_len(s)
        if shorter is not None:
            before = s.kv_capacity_tokens / (math.ceil(s.max_model_len / s.block_size) * s.block_size)
            after = s.kv_capacity_tokens / (math.ceil(shorter / s.block_size) * s.block_size)
            out.append(Lever("--max-model-len", f"{shorter}", (
                f"the worst case vLLM admits (requests of the full length) {before:.1f} -> {after:.1f} at once; the "
                f"pool holds the same {s.kv_capacity_tokens:,.0f} tokens, so requests of {s.request_tokens:,} "
                "tokens gain only where vLLM held room for longer ones")))  # fmt: skip
    if (scale := tp_against_replicas(s)) is not None:
        out.append(scale)
    return out


def tp_against_replicas(s: Situation) -> Lever | None:
    """On twice the GPUs: TP x 2 (each rank holds half the weights it held, the rest of the budget alike: the
    planner's tokens for the pool that frees) against two replicas of today's TP; None without the model's config,
    the pool and the weights (sweep --vllm-log), or where the planner does not size it."""
    if s.geometry is None or not s.pool_bytes or not s.weights_bytes or not s.max_model_len:
        return None
    tp = s.tp * 2
    inputs = sizing.PlanInputs(
        kv_cache_memory_bytes=int(s.pool_bytes),
        max_model_len=s.max_model_len,
        tp=s.tp,
        kv_cache_dtype=s.kv_cache_dtype or "auto",
        **({"block_size": s.block_size} if s.block_size else {}),  # type: ignore[arg-type]
        **({"version": s.version} if s.version is not None else {}),  # type: ignore[arg-type]
    )
    freed = doubled_tp_pool(s.pool_bytes, s.weights_bytes, s.tp)
    try:
        one = sizing.plan(s.geometry, inputs)
        two = sizing.plan(s.geometry, replace(inputs, tp=tp, kv_cache_memory_bytes=freed))
    except (ValueError, sizing.NotModelled, sizing.ImpossiblePlan):
        return None
    replicas, each = 2 * one.kv_cache_tokens, s.request_tokens
    compare = (
        f"on twice the GPUs, TP {tp} holds {two.kv_cache_tokens:,} tokens ({two.kv_cache_tokens / each:.1f} requests "
        f"of {each:,}) and two replicas of TP {s.tp} {replicas:,} ({replicas / each:.1f}), by the planner for the "
        "pool the log gave and half the weights a rank"
    )
    if two.kv_cache_tokens >= replicas * TP_GAIN:
        return Lever("--tensor-parallel-size", str(tp), (
            f"{compare}: an estimate (the same CUDA graphs and activations a GPU); each step adds an all-reduce per "
            "layer (a few % over NVLink, more over PCIe), and a TP group fails as one"))  # fmt: skip
    return Lever("replicas", "2", (
        f"{compare}: TP {tp} gains under {TP_GAIN - 1:.0%} over replicas, which add no all-reduce and fail "
        "alone"))  # fmt: skip


def fp8_ratio(s: Situation) -> tuple[float, str]:
    """The tokens an fp8 cache holds over the current one: the planner's where the model is known, else 2."""
    if s.geometry is None or not s.kv_capacity_tokens or not s.max_model_len:
        return 2.0, "an estimate: 1 byte an element, not 2; give --model-config for the planner's figure"
    inputs = sizing.PlanInputs(
        kv_cache_memory_bytes=8 << 30,  # any pool: the ratio of tokens is the ratio of bytes per token
        max_model_len=s.max_model_len,
        tp=s.tp,
        kv_cache_dtype=s.kv_cache_dtype or "auto",
        **({"version": s.version} if s.version is not None else {}),  # type: ignore[arg-type]
    )
    try:
        now = sizing.plan(s.geometry, inputs)
        fp8 = sizing.plan(s.geometry, replace(inputs, kv_cache_dtype="fp8"))
    except (ValueError, sizing.NotModelled, sizing.ImpossiblePlan):
        return 2.0, "an estimate: the planner does not size this model"
    return fp8.kv_cache_tokens / now.kv_cache_tokens, "the planner's figure for this model and release"


def _shorter_max_model_len(s: Situation) -> int | None:
    """A max_model_len that still covers the requests swept, rounded up to a power of two; None if not shorter."""
    assert s.max_model_len is not None
    shorter = 1 << max(0, math.ceil(math.log2(max(s.request_tokens, 1))))
    return shorter if shorter < s.max_model_len else None


def _seqs_levers(s: Situation) -> list[Lever]:
    if s.kv_usage_max is not None and s.kv_usage_max >= 0.9:
        return []  # the KV cache is nearly full too: more sequences would be preempted
    room = s.kv_capacity_tokens / s.request_tokens if s.kv_capacity_tokens else None
    value = max(2 * (s.max_num_seqs or s.concurrency), 1)
    if room is not None:
        value = max(min(value, int(room)), (s.max_num_seqs or 0) + 1)
    usage = f"{s.kv_usage_max:.0%}" if s.kv_usage_max is not None else "not read"
    effect = f"{s.max_num_seqs or '?'} requests ran at once while the KV cache was {usage} full at most"
    if room is not None:
        effect += f"; it holds {room:.1f} requests of {s.request_tokens:,} tokens"
    return [Lever("--max-num-seqs", str(value), effect + ": more run at once, each step longer (TPOT rises)")]


def _budget_levers(s: Situation) -> list[Lever]:
    now = s.max_num_batched_tokens
    value = str(2 * now) if now else "twice the current"
    return [Lever("--max-num-batched-tokens", value, (
        f"the steps were nearly as large as the budget of {now or '?'} tokens: larger prefill chunks, TTFT of waiting "
        "requests falls, TPOT of running ones rises while a chunk runs"))]  # fmt: skip


def _queue_levers(s: Situation) -> list[Lever]:
    return [Lever("--max-num-queued-reqs", "higher, or unset", (
        "vLLM's queue cap refused requests at the door: they were not served at all; raise it if clients can wait, "
        "or add replicas"))]  # fmt: skip


def _scale_levers(s: Situation) -> list[Lever]:
    why = "the latency objective" if s.limit == "slo" else "no capacity limit (latency rises with the batch)"
    return [Lever("replicas", f"ceil(peak concurrency / {s.concurrency})", (
        f"{why} binds at {s.concurrency} concurrent requests: each replica serves {s.concurrency} within it; "
        "tensor parallelism instead lowers each step's time (communication costs some of it)"))]  # fmt: skip
