"""The latency learner: one curve of latency by concurrency and one context distribution per engine, taught from
vLLM's histograms as the loop reads them (the curves themselves: :mod:`vllm_capacity.derive.latency_curve`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import structlog

from vllm_capacity import derive
from vllm_capacity.derive.latency_curve import (
    DEFAULT_HALF_LIFE,
    GENERATION,
    ITL,
    PROMPT,
    TTFT,
    Buckets,
    ContextTokens,
    LatencyCurve,
    Objective,
    below_resolution,
    slo_bound,
)
from vllm_capacity.live.status import first_time
from vllm_capacity.sources.vllm_metrics.records import EngineKey, VllmMetrics

LATENCY_EVERY = 5.0  # seconds: how often a cycle reads vLLM's latency histograms (most of its lines) to learn from
#: how fast each histogram's count can rise: requests (or engine steps) for most, tokens for the inter-token latency
RISES = {ITL: derive.MAX_TOKENS_PER_SECOND}


class LatencyLearner:
    """Notes each engine's running requests every cycle and, every LATENCY_EVERY seconds, teaches its curve the
    interval since the last time: the histograms' increase at the mean running requests of those seconds."""

    def __init__(
        self,
        objectives: Sequence[Objective] = (),
        half_life: float = DEFAULT_HALF_LIFE,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.objectives, self.half_life, self.monotonic = tuple(objectives), half_life, monotonic
        self.logger = structlog.get_logger("vllm_capacity")
        self._curves: dict[EngineKey, LatencyCurve] = {}
        self._contexts: dict[EngineKey, ContextTokens] = {}
        self._views: dict[EngineKey, derive.LatencyView] = {}
        self._running_seen: dict[EngineKey, tuple[float, int]] = {}
        # vllm:iteration_tokens_total (buckets, sum) at the last latency read
        self._steps: dict[EngineKey, tuple[Buckets, float | None]] = {}
        self._read_at: float | None = None  # when the last latency read was learned from
        self._tried_at: float | None = None  # when a latency read was last tried, whether or not it came back
        self._unresolvable_logged: set[str] = set()
        self._totals: dict[EngineKey, dict[str, float]] = {}  # each histogram's count at the last read learned from

    @property
    def views(self) -> Mapping[EngineKey, derive.LatencyView]:
        """What is exported of each engine's curve, as of the last time it learned."""
        return self._views

    def due(self) -> bool:
        """Whether this cycle should read vLLM's latency histograms (the first one does, then every LATENCY_EVERY
        after the last try: a read that failed is not retried every cycle, the larger read is what may fail)."""
        return self._tried_at is None or self.monotonic() - self._tried_at >= LATENCY_EVERY

    def missed(self) -> None:
        """A latency read was tried and did not come back: the next try keeps the schedule."""
        self._tried_at = self.monotonic()

    def learn(self, metrics: VllmMetrics, read: bool) -> tuple[str, ...]:
        """Note each engine's running requests; when this cycle read the latency histograms, teach each engine's
        curve the interval since the last time, and refresh what is exported of it (computed here, not every
        cycle: quantiles of every bin are the costly part). Returns the histograms this read could not have (risen
        further than can be right), which taught nothing."""
        for m in metrics.engines:
            if m.running is not None:
                total, n = self._running_seen.get((m.model_name, m.engine), (0.0, 0))
                self._running_seen[(m.model_name, m.engine)] = (total + m.running, n + 1)
        if not read:
            return ()
        now = self.monotonic()
        seconds = now - self._read_at if self._read_at is not None else 0.0
        self._read_at = self._tried_at = now
        present, refused = set(), set()
        for m in metrics.engines:
            key = (m.model_name, m.engine)
            present.add(key)
            total, n = self._running_seen.pop(key, (0.0, 0))
            implausible = self._implausible(key, m.latency, seconds)
            if implausible:  # this read teaches nothing; the view and every base stand as they were
                refused.update(implausible)
                continue
            curve = self._curves.setdefault(key, LatencyCurve(half_life=self.half_life))
            cc = m.cache_config
            kv_bound = derive.blocks_per_engine(cc.num_gpu_blocks if cc else None, metrics.dp_engines, metrics.schema)
            latency = {k: v for k, v in m.latency.items() if k in (ITL, TTFT)}
            self._warn_unresolvable(latency)
            curve.observe(latency, total / n if n else None, seconds, kv_bound)
            context = self._contexts.setdefault(key, ContextTokens(half_life=self.half_life))
            context.observe({k: v for k, v in m.latency.items() if k in (PROMPT, GENERATION)}, seconds)
            bound = slo_bound(curve, self.objectives)
            steps, steps_sum = self._step_increase(key, m.latency.get("steps"), m.step_tokens_sum)
            self._views[key] = derive.LatencyView(
                quantiles=curve.quantiles(),
                observations=curve.observations(),
                slo_max_concurrency=bound.max_concurrency,
                slo_knee_observed=bound.knee_observed if self.objectives else None,
                context_p90_tokens=context.quantile(),
                step_tokens=steps,
                step_tokens_sum=steps_sum,
            )
        self._running_seen.clear()  # what is left belongs to engines that went away
        for gone in set(self._curves) - present:  # an engine that went away takes what it taught with it
            del self._curves[gone]
            self._contexts.pop(gone, None)
            self._views.pop(gone, None)
            self._steps.pop(gone, None)
            self._totals.pop(gone, None)
        return tuple(sorted(refused))

    def _implausible(self, key: EngineKey, histograms: Mapping[str, Buckets], seconds: float) -> list[str]:
        """The histograms whose count rose further since the last read than any engine could: one TTFT jump of
        1e12 set p50, p90 and p99 to 2,560 s and removed the SLO bound. The counts of a read that passes are noted."""
        counts = {kind: buckets[-1][1] for kind, buckets in histograms.items() if buckets}
        before = self._totals.get(key, {})
        bad = [
            kind
            for kind, count in counts.items()
            if kind in before
            and count >= before[kind]  # gone down: a restart, which the curves handle
            and not derive.plausible_rise(count - before[kind], seconds, RISES.get(kind, derive.MAX_EVENTS_PER_SECOND))
        ]
        if not bad:
            self._totals[key] = counts
        return [f"vllm histogram {kind}" for kind in bad]

    def _step_increase(
        self, key: EngineKey, steps: Buckets | None, total: float | None
    ) -> tuple[tuple[tuple[float, float], ...], float | None]:
        """The step-size histogram's increase since the last latency read, buckets and sum (nothing the first time,
        after a restart of vLLM (a count went down) or a new bucket layout; no sum where vLLM's went down or was not
        read)."""
        before = self._steps.get(key)
        if steps is None:
            self._steps.pop(key, None)
            return (), None
        self._steps[key] = (steps, total)
        if before is None or [le for le, _ in before[0]] != [le for le, _ in steps]:
            return (), None
        increase = tuple((le, now - then) for (le, now), (_, then) in zip(steps, before[0], strict=True))
        if not all(d >= 0 for _, d in increase):
            return (), None
        added = total - before[1] if total is not None and before[1] is not None else None
        return increase, added if added is not None and added >= 0 else None

    def _warn_unresolvable(self, histograms: Mapping[str, Buckets]) -> None:
        """Once per objective: say so when it lies below the first bucket of the histogram it is learned from."""
        for objective, first in below_resolution(self.objectives, histograms):
            if first_time(self._unresolvable_logged, str(objective)):
                self.logger.warning(
                    "slo_objective_below_histogram_resolution",
                    objective=str(objective),
                    first_bucket_seconds=first,
                    hint=f"vLLM's histogram cannot tell latencies under {first * 1000:g} ms apart: the concurrency "
                    "this objective allows is a guess; choose an objective at or above that bucket",
                )
