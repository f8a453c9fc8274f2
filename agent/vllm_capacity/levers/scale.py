"""advise's rules of scale: the memory budget (gpu_memory_utilization, as the release in use sizes it), the replicas
at the window's peak, and TP against replicas by the planner (docs/advise.md)."""

from __future__ import annotations

import math

from vllm_capacity.levers.window import Asked, Finding, NotAdvised, Observed, Recommendation, plan_of, release
from vllm_capacity.sizing.versions import EXTENSIBLE_KV_CACHE
from vllm_capacity.units import GiB, format_bytes

#: the memory a raised --gpu-memory-utilization leaves free on the GPU, of what the window's minimum was
FREE_MARGIN = 1 * GiB
HIGHEST_UTILIZATION = 0.95
#: TP=2 is advised over two replicas only where it holds this much more KV cache on the same two GPUs
TP_GAIN = 1.1


def doubled_tp_pool(pool_bytes: float, weights_bytes: float, tp: int) -> int:
    """A rank's KV pool at TP x 2 on the same GPUs: its pool now plus the half of its weights it no longer holds (an
    estimate: the same CUDA graphs and activations a GPU)."""
    return int(pool_bytes + weights_bytes - weights_bytes * tp / (tp * 2))


def gpu_memory_utilization(o: Observed) -> Finding:
    flag = "gpu_memory_utilization"
    version, label = release(o), o.info.get("gpu_memory_utilization", "")
    total = o.value("gpu_total_bytes")
    try:
        gmu: float | None = float(label)
    except ValueError:
        gmu = None
    if version is None:
        return NotAdvised(
            flag, "no vLLM version in vllm_capacity_vllm_info: whose sizing rules apply is unknown", gap=True
        )
    if version >= EXTENSIBLE_KV_CACHE:
        if gmu is None or gmu >= 1.0:
            return NotAdvised(
                flag,
                f"vLLM {o.info.get('version')} sizes the KV cache after warm-up (the extensible "
                "cache) and gpu_memory_utilization is unset: nothing to change",
            )
        kept = f"{format_bytes((1 - gmu) * total)} of each GPU" if total else f"{1 - gmu:.0%} of each GPU"
        return Recommendation(
            flag,
            f"{gmu:g}",
            "unset (1.0)",
            (
                f"vLLM {o.info.get('version')} sizes the KV cache to the memory free after warm-up (the extensible "
                f"cache); {gmu:g} keeps {kept} out of it, and vLLM warns of it: leave it unset unless that memory is "
                "for something vLLM does not measure (other processes, a KV connector's buffers)"
            ),
            tuple(f for f in (o.get("gpu_total_bytes"),) if f),
            "0.34's extensible KV cache: leave it unset",
        )
    free = o.value("gpu_free_min_bytes")
    if not total or free is None:
        return NotAdvised(flag, "no GPU memory series (vllm_capacity_gpu_memory_bytes: the agent with NVML)", gap=True)
    if not o.value("preemptions") or gmu is None:
        return NotAdvised(flag, f"the KV cache did not bind in {o.window}: no memory needed")
    extra = free - FREE_MARGIN
    advised = math.floor(min(HIGHEST_UTILIZATION, gmu + extra / total) * 100) / 100
    if extra <= 0 or advised <= gmu:
        return NotAdvised(flag, f"at least {format_bytes(free)} stayed free on the GPU: nothing to give the cache")
    cap, pool = o.value("capacity_tokens"), o.value("pool_bytes")
    more = (advised - gmu) * total
    tokens = f" (about {cap / pool * more:,.0f} tokens)" if cap and pool else ""
    return Recommendation(
        flag,
        f"{gmu:g}",
        f"{advised:.2f}",
        (
            f"at least {format_bytes(free)} of {format_bytes(total)} stayed free all {o.window} while requests were "
            f"preempted: {format_bytes(more)} more KV cache{tokens}, {format_bytes(free - more)} "
            "still free"
        ),
        (o.get("gpu_free_min_bytes"), o.get("gpu_total_bytes"), o.get("preemptions")),
        f"budget = total x gpu_memory_utilization; keep {format_bytes(FREE_MARGIN)} of the window's least free memory",
    )


def replicas(o: Observed, asked: Asked) -> Finding:
    flag = "replicas"
    peak, now = o.value("peak_demand"), o.value("replicas")
    knee = o.value("slo_knee") if o.value("slo_knee_observed") else None
    kv_each = o.value("per_replica_p90")
    if peak is None or not now:
        return NotAdvised(flag, "no vllm_capacity_requests_running / requests_waiting in the window", gap=True)
    each = min(x for x in (knee, kv_each) if x) if (knee or kv_each) else None
    if not each:
        return NotAdvised(
            flag, 'no latency knee and no max_concurrency{basis="p90_context"}: a replica\'s share unknown', gap=True
        )
    why = (
        f"the latency knee at {knee:.0f} running requests"
        if knee and each == knee
        else f'{each:.1f} requests at the p90 context per replica (max_concurrency{{basis="p90_context"}})'
    )
    needed = max(1, math.ceil(peak * (1 + asked.headroom) / each))
    if needed == now:
        return NotAdvised(
            flag,
            f"the window's peak of {peak:.0f} requests (running + waiting) with "
            f"{asked.headroom:.0%} headroom needs the {now:.0f} there are ({why})",
        )
    effect = (
        f"the window's peak of {peak:.0f} requests (running + waiting) with {asked.headroom:.0%} headroom, "
        f"{why}: {needed} replicas ({now:.0f} now)"
    )
    evidence = tuple(
        f for f in (o.get("peak_demand"), o.get("replicas"), o.get("slo_knee"), o.get("per_replica_p90")) if f
    )
    return Recommendation(
        flag,
        f"{now:.0f}",
        str(needed),
        effect,
        evidence,
        "ceil(peak x (1 + headroom) / min(knee, p90-context concurrency))",
        {"peak_demand": peak, "per_replica": each, "replicas_needed": float(needed)},
    )


def tensor_parallel(o: Observed, asked: Asked) -> Finding:
    flag = "tensor_parallel_size"
    if asked.geometry is None:
        return NotAdvised(flag, "no --model-config: TP against replicas needs the planner", gap=True)
    pool, weights = o.value("pool_bytes"), o.value("weights_bytes")
    one = plan_of(o, asked)
    if one is None or not pool or not weights:
        return NotAdvised(
            flag, "no KV pool, weights or vLLM version series, or a model the planner does not size", gap=True
        )
    tp = asked.tp * 2
    # the same GPUs: each rank holds 1/tp of the weights, the rest of the budget alike (an estimate)
    two = plan_of(o, asked, tp=tp, kv_cache_memory_bytes=doubled_tp_pool(pool, weights, asked.tp))
    if two is None:
        return NotAdvised(flag, f"the planner refuses TP {tp} for this model")
    replicas = 2 * one.kv_cache_tokens
    compare = (
        f"on {tp // asked.tp}x the GPUs: TP {tp} holds {two.kv_cache_tokens:,} tokens "
        f"({two.max_concurrency:.2f}x at max_model_len), two replicas of TP {asked.tp} "
        f"{replicas:,} ({2 * one.max_concurrency:.2f}x)"
    )
    if not o.value("preemptions") or two.kv_cache_tokens < replicas * TP_GAIN:
        return NotAdvised(
            flag,
            f"{compare}: replicas (no all-reduce per step; the KV cache "
            f"{'did not bind' if not o.value('preemptions') else 'gains under 10 % from TP'})",
        )
    return Recommendation(
        flag,
        str(asked.tp),
        str(tp),
        (
            f"{compare}: the weights split over {tp} ranks leave more of each GPU to the KV cache; an estimate (the "
            "same "
            "CUDA graphs and activations per GPU); each step adds an all-reduce per layer (a few % over NVLink, more "
            "over PCIe) and a TP group fails as one"
        ),
        (o.get("pool_bytes"), o.get("weights_bytes"), o.get("preemptions")),
        "planner: kv_cache_memory_bytes + weights x (1 - 1/2) per rank at tp x 2, against 2 x the tokens at tp",
        {"kv_cache_tokens_tp": float(two.kv_cache_tokens), "kv_cache_tokens_replicas": float(replicas)},
    )
