"""What to change, from a window of real traffic: the rules of ``vllm-capacity advise`` over plain figures.

Each figure is what one PromQL query answered (:class:`Figure`: its value, the query and the time it was evaluated
at), so every number a recommendation cites can be re-run. The rules are those docs/advise.md explains; the KV-cache
numbers come from the planner where the model's config.json is given (the release's own sizing rules), the levers
of the limits from :mod:`vllm_capacity.levers.advice`, the engine ``sweep`` uses. A rule the figures cannot support
makes no recommendation: it says what is missing, or why nothing needs to change.
"""

from __future__ import annotations

import math

from vllm_capacity.levers.advice import SIXTEEN_BIT, Situation, fp8_ratio, levers
from vllm_capacity.levers.scale import gpu_memory_utilization, replicas, tensor_parallel
from vllm_capacity.levers.window import (
    Asked,
    Finding,
    NotAdvised,
    Observed,
    Recommendation,
    block_size,
    plan_of,
    release,
)

#: max_model_len is advised in whole K: vLLM's --max-model-len reads "7K" as 7,168, and 1,024 tokens are a whole
#: number of blocks at every block size vLLM uses (16 to 256)
ROUND_TOKENS = 1024
#: a shorter max_model_len is advised only where it frees a quarter or more of the worst case's concurrency
MAX_MODEL_LEN_GAIN = 1.25
#: the fewest requests in the window for a p99.9 of their lengths
MIN_REQUESTS = 1000
#: a limit that bound this share of the window or more is acted on
BINDS = 0.05
#: preemptions in an hour whose demand was at least this share of the window's peak are "at the peaks"
PEAK_SHARE = 0.8


def advise(o: Observed, asked: Asked) -> list[Finding]:
    """Every rule over one deployment, in the order docs/advise.md gives them."""
    return [
        _max_model_len(o, asked),
        _kv_cache_dtype(o, asked),
        _max_num_seqs(o),
        _max_num_batched_tokens(o),
        gpu_memory_utilization(o),
        replicas(o, asked),
        tensor_parallel(o, asked),
    ]


def _worst_case(o: Observed, asked: Asked, mml: int) -> tuple[float | None, str]:
    """Requests of ``mml`` tokens that fit at once: the planner's, else capacity over whole blocks of mml."""
    plan = plan_of(o, asked, max_model_len=mml)
    if plan is not None:
        return plan.max_concurrency, "the planner's max_concurrency for this model, pool and release"
    cap, bs = o.value("capacity_tokens"), block_size(o)
    if not cap or mml < 1:
        return None, ""
    return cap / (math.ceil(mml / bs) * bs), "kv_cache_capacity_tokens / max_model_len in whole blocks"


def _max_model_len(o: Observed, asked: Asked) -> Finding:
    flag = "max_model_len"
    mml, requests = o.value("max_model_len"), o.value("requests")
    prompt, output = o.value("prompt_p999"), o.value("output_p999")
    if not mml:
        return NotAdvised(flag, "no vllm_capacity_max_model_len_tokens in the window", gap=True)
    if prompt is None or output is None or requests is None:
        return NotAdvised(flag, "no vllm:request_prompt_tokens / vllm:request_generation_tokens histograms", gap=True)
    if requests < MIN_REQUESTS:
        return NotAdvised(flag, f"{requests:,.0f} requests in {o.window}: fewer than {MIN_REQUESTS:,} for a p99.9")
    for name, p999 in (("prompt", prompt), ("output", output)):
        top = o.value(f"{name}_top_bucket")
        if top is not None and p999 >= top:
            return NotAdvised(
                flag,
                f"p99.9 of {name} tokens is past vLLM's largest finite bucket ({top:,.0f}): how "
                "long those requests are is not known, so no shorter max_model_len is advised",
            )
    longest = prompt + output
    advised = max(ROUND_TOKENS, math.ceil(longest / ROUND_TOKENS) * ROUND_TOKENS)
    now, how = _worst_case(o, asked, int(mml))
    then, _ = _worst_case(o, asked, advised)
    if advised >= mml or now is None or then is None or then < now * MAX_MODEL_LEN_GAIN:
        return NotAdvised(
            flag,
            f"p99.9 of requests {longest:,.0f} tokens (prompt {prompt:,.0f} + output "
            f"{output:,.0f}) against max_model_len {mml:,.0f}: no shorter value frees a quarter of "
            "the worst case",
        )
    effect = (
        f"covers p99.9 of the window's requests ({prompt:,.0f} prompt + {output:,.0f} output tokens = "
        f"{longest:,.0f}); the worst case vLLM admits (every request of max_model_len) {now:.2f}x -> {then:.2f}x "
        f"at once ({how}); requests longer than {advised:,} (at most 0.1 % of them) would be refused with HTTP 400"
    )
    rule = "p99.9 prompt + p99.9 output, rounded up to whole K (1,024 tokens; vLLM reads 7K as 7,168)"
    evidence = tuple(o.get(n) for n in ("prompt_p999", "output_p999", "requests", "max_model_len", "capacity_tokens"))
    numbers = {"request_tokens_p999": longest, "max_concurrency_now": now, "max_concurrency_advised": then}
    return Recommendation(flag, f"{mml:.0f}", str(advised), effect, evidence, rule, numbers)


def _peaks(o: Observed) -> tuple[int, int]:
    """Hours with preemptions, and how many of them had demand at PEAK_SHARE of the window's peak or more."""
    hours = [t for t, v in o.preempted_hours.items() if v > 0]
    peak = max(o.demand_hours.values(), default=0.0)
    at_peak = [t for t in hours if peak and o.demand_hours.get(t, 0.0) >= PEAK_SHARE * peak]
    return len(hours), len(at_peak)


def _kv_cache_dtype(o: Observed, asked: Asked) -> Finding:
    flag = "kv_cache_dtype"
    preempted, shed = o.value("preemptions"), o.value("shed")
    if preempted is None:
        return NotAdvised(flag, "no vllm_capacity_preemptions_total in the window", gap=True)
    if preempted < 1 and not shed:
        return NotAdvised(flag, f"no preemptions or shed requests in {o.window}: fp8 KV not needed for capacity")
    dtype = o.info.get("cache_dtype") or "auto"
    if dtype not in SIXTEEN_BIT:
        return NotAdvised(flag, f"the KV cache is already {dtype}: add replicas or shorten max_model_len instead")
    cap, mml = o.value("capacity_tokens"), o.value("max_model_len")
    now, fp8 = plan_of(o, asked), plan_of(o, asked, kv_cache_dtype="fp8")
    if now is not None and fp8 is not None:  # the planner's tokens for this pool, release and model
        return _fp8(
            o,
            dtype,
            fp8.kv_cache_tokens / now.kv_cache_tokens,
            "the planner's figure for this pool",
            float(now.kv_cache_tokens),
            float(fp8.kv_cache_tokens),
        )
    ratio, how = fp8_ratio(
        Situation(
            "kv_cache",
            1,
            1,
            kv_capacity_tokens=cap,
            max_model_len=int(mml) if mml else None,
            kv_cache_dtype=dtype,
            geometry=asked.geometry,
            tp=asked.tp,
            version=release(o),
        )
    )
    return _fp8(o, dtype, ratio, how, cap, cap * ratio if cap else None)


def _fp8(o: Observed, dtype: str, ratio: float, how: str, cap: float | None, then_tokens: float | None) -> Finding:
    preempted, shed = o.value("preemptions") or 0.0, o.value("shed")
    hours, at_peak = _peaks(o)
    when = (
        f" in {hours} hour(s), {at_peak} of them at {PEAK_SHARE:.0%} or more of the window's peak demand"
        if hours
        else ""
    )
    then = f"{cap:,.0f} -> {then_tokens:,.0f} tokens per engine ({ratio:.2f}x, {how})" if cap else f"{ratio:.2f}x"
    queued = o.value("waiting_for_capacity_max")
    waited = f", up to {queued:,.0f} requests waiting for KV capacity at once" if queued else ""
    effect = (
        f"{preempted:,.0f} preemptions and {shed or 0:,.0f} shed requests in {o.window}{when}{waited}; KV cache "
        f"{then} in the same memory; fp8 KV costs some accuracy on some models: check yours"
    )
    evidence = tuple(
        f
        for f in (
            o.get("preemptions"),
            o.get("shed"),
            o.get("waiting_for_capacity_max"),
            o.get("capacity_tokens"),
            o.hours,
        )
        if f
    )
    rule = "preemptions or shed requests in the window, a 16-bit KV cache: fp8 holds the planner's ratio more"
    numbers = {"preempted_hours": float(hours), "preempted_hours_at_peak": float(at_peak), "ratio": ratio}
    if cap and then_tokens:
        numbers |= {"kv_cache_tokens_now": cap, "kv_cache_tokens_advised": then_tokens}
    return Recommendation("kv_cache_dtype", dtype, "fp8", effect, evidence, rule, numbers)


def _share(o: Observed, limit: str) -> float:
    return o.value(f"limit_{limit}") or 0.0


def _max_num_seqs(o: Observed) -> Finding:
    """Where max_num_seqs bound before the KV cache did (raise it), or the objective broke at the concurrency it
    allows (lower it to the knee)."""
    running, knee = o.value("running_max"), o.value("slo_knee")
    usage, share = o.value("kv_usage_max"), _share(o, "max_num_seqs")
    most = f"{running:.0f} (the most that ran)" if running is not None else "unknown"
    if share >= BINDS and running:
        situation = Situation("max_num_seqs", int(running), _typical_request(o),
                              kv_capacity_tokens=o.value("capacity_tokens"), kv_usage_max=usage,
                              max_num_seqs=int(running))  # fmt: skip
        for lever in levers(situation):
            evidence = (o.get("limit_max_num_seqs"), o.get("running_max"), o.get("kv_usage_max"))
            return Recommendation("max_num_seqs", most, lever.value, f"bound {share:.0%} of {o.window}: "
                                  f"{lever.effect}", evidence, "max_num_seqs bound while the KV cache had room "
                                  "(levers.advice)")  # fmt: skip
        return NotAdvised("max_num_seqs", f"bound {share:.0%} of {o.window} but the KV cache was {usage or 0:.0%} "
                          "full: more sequences would be preempted")  # fmt: skip
    if o.value("slo_knee_observed") and knee and running and running >= knee * 1.25:
        effect = (
            f"the latency objective broke above {knee:.0f} running requests and up to {running:.0f} ran: a cap at "
            f"{knee:.0f} keeps the running ones within it while the rest wait (their TTFT grows): pair it with the "
            "replicas below"
        )
        evidence = (o.get("slo_knee"), o.get("slo_knee_observed"), o.get("running_max"))
        return Recommendation("max_num_seqs", most, f"{knee:.0f}", effect, evidence,
                              "the SLO knee below the concurrency max_num_seqs allowed")  # fmt: skip
    return NotAdvised("max_num_seqs", f"bound {share:.0%} of {o.window}, and no latency objective broke below the "
                      "concurrency it allows")  # fmt: skip


def _max_num_batched_tokens(o: Observed) -> Finding:
    """Where the token budget bound: the budget lever."""
    running = o.value("running_max")
    budget_share = _share(o, "token_budget")
    if budget_share >= BINDS:
        (lever,) = levers(Situation("token_budget", int(running or 1), _typical_request(o)))
        return Recommendation(
            "max_num_batched_tokens",
            "?",
            lever.value,
            f"bound {budget_share:.0%} of {o.window}: {lever.effect}",
            (o.get("limit_token_budget"),),
            "the token budget bound (levers.advice)",
        )
    return NotAdvised("max_num_batched_tokens", f"the token budget bound {budget_share:.0%} of {o.window}")


def _typical_request(o: Observed) -> int:
    prompt, output = o.value("prompt_p999"), o.value("output_p999")
    return max(1, int(prompt + output)) if prompt is not None and output is not None else 1
