"""What the agent reads of vLLM's features beside the KV cache, per engine: the latency it learned (for export),
the concurrency vLLM sustains, speculative decoding's acceptance, LoRA's adapter slots. Plain records and the
functions that make them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_capacity.sources.vllm_metrics.records import SCHEMA_V0, EngineMetrics, LoraRequests


@dataclass(frozen=True)
class LatencyView:
    """What the agent learned of an engine's latency by concurrency (:mod:`vllm_capacity.derive.latency_curve`), for
    export."""

    quantiles: Mapping[tuple[str, int, float], float] = field(default_factory=dict)  # (kind, bin, q) -> seconds
    observations: Mapping[tuple[str, int], float] = field(default_factory=dict)  # (kind, bin) -> decayed count
    slo_max_concurrency: int | None = None  # with objectives, once known
    slo_knee_observed: bool | None = None  # None without objectives
    context_p90_tokens: float | None = None  # p90 prompt + p90 generation tokens of finished requests
    #: vllm:iteration_tokens_total's increase over the last latency interval: (upper bound, steps), cumulative
    step_tokens: tuple[tuple[float, float], ...] = ()
    step_tokens_sum: float | None = None  # and its sum's: the tokens those steps computed


@dataclass(frozen=True)
class Sustained:
    """The concurrency vLLM sustains, learned from the agent's reads: the running requests at the reads where
    requests waited for capacity or vLLM had just preempted (whatever the limit: KV cache, batch cap, token budget,
    CPU), as a mean whose weights halve every ``half_life`` seconds. Until such a read, ``level`` is the most
    requests seen running (a lower bound) and ``observed`` is False."""

    level: float | None = None
    observed: bool = False
    weight: float = 0.0  # the decayed number of pressed reads behind ``level``
    at: float | None = None  # when it last learned (monotonic seconds)


NO_SUSTAINED = Sustained()


def learn_sustained(known: Sustained, running: float | None, pressed: bool, now: float, half_life: float) -> Sustained:
    """``known`` after one more read: ``pressed`` when requests wait for capacity or vLLM preempted since the last
    read; then ``running`` is a level vLLM holds under pressure. A calm read can only raise the lower bound. A pressed
    read with nothing running teaches nothing: it is an instant, not a level (the load's first requests queued before
    vLLM's next step, or all it ran just preempted), and a level of 0 would say vLLM can serve nothing (the fleet
    rule's replicas needed became NaN, 0 / 0, in the e2e stack)."""
    if running is None or (pressed and running <= 0):
        return known
    if not pressed:  # only a higher lower bound, and only once something ran
        if known.observed or running <= (known.level or 0.0):
            return known
        return Sustained(level=running, at=now)
    decay = 0.5 ** ((now - known.at) / half_life) if known.observed and known.at is not None else 0.0
    weight = known.weight * decay
    before = known.level if known.observed and known.level is not None else running
    level = before + (running - before) / (weight + 1.0)  # the same level read again stays exactly that level
    return Sustained(level=level, observed=True, weight=weight + 1.0, at=now)


MIN_STEPS = 20  # engine steps a window needs before the share of large ones says anything


def budget_fill(step_tokens: tuple[tuple[float, float], ...], tokens: float | None, budget: int | None) -> float | None:
    """How full the engine's steps were over the last window, as a share of the scheduler's token budget
    (--max-num-batched-tokens): the tokens they computed over the steps, over the budget, at most 1. Near 1, every
    step is as large as vLLM allows, and a request that waits cannot be admitted for want of tokens in the step. The
    mean, not the buckets: under chunked prefill a prompt's tokens are observed at once when its prefill ends, so the
    steps that read it look small and the last one holds the whole prompt. None without the budget or the sum, or
    with fewer than MIN_STEPS steps."""
    if not budget or tokens is None or not step_tokens or step_tokens[-1][1] < MIN_STEPS:
        return None
    return min(1.0, tokens / step_tokens[-1][1] / budget)


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


def spec_decode(m: EngineMetrics) -> SpecDecode | None:
    """The engine's acceptance figures; None when it does not decode speculatively (no counters)."""
    if m.spec_draft_tokens_total is None or m.spec_accepted_tokens_total is None:
        return None
    return SpecDecode(m.spec_draft_tokens_total, m.spec_accepted_tokens_total, m.spec_drafts_total)
