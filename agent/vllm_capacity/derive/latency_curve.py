"""Latency by concurrency, learned passively from vLLM's own histograms; the concurrency a latency objective allows.

Pure functions and plain state, no I/O. Every few seconds the agent hands :meth:`LatencyCurve.observe` an engine's
cumulative latency histograms (inter-token latency, time to first token) and the mean of its running requests over
the interval since the last time (sampled every cycle). The increase of each histogram over the interval is
attributed to that concurrency and added to its bin, a histogram of its own whose counts decay with a
half-life of traffic (intervals without new observations do not age it), so that the curve follows today's traffic.

* Bins: at most :data:`MAX_BINS`, upper bounds spaced geometrically from 1 to the KV-bound max concurrency
  (:func:`bin_bounds`); a new bound set (vLLM restarted with another cache) starts afresh.
* A counter that went down (vLLM restarted) or a changed bucket layout: that interval is skipped, and a new layout
  starts that histogram afresh.
* Quantiles follow Prometheus' ``histogram_quantile`` (:func:`histogram_quantile`).
* A quantile is known only with enough observations: at least ``10 / (1 - q)`` (20 for p50, 100 for p90, 1,000 for
  p99), so that ten observations lie above it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_capacity.units import parse_duration

MAX_BINS = 16
QUANTILES = (0.5, 0.9, 0.99)
ITL = "itl"
TTFT = "ttft"
DEFAULT_HALF_LIFE = 3600.0  # seconds of traffic

Buckets = Sequence[tuple[float, float]]  # (upper bound "le", cumulative count), ascending, +Inf last


def bin_bounds(max_concurrency: float | None) -> tuple[int, ...]:
    """Upper bounds of the concurrency bins: 1 .. ceil(max_concurrency), at most MAX_BINS, geometric."""
    top = max(1, math.ceil(max_concurrency)) if max_concurrency and math.isfinite(max_concurrency) else 256
    bounds = sorted({max(1, round(top ** (i / (MAX_BINS - 1)))) for i in range(MAX_BINS)})
    return tuple(bounds)


def needed(q: float) -> float:
    """Observations needed before quantile ``q`` is reported: ten above it."""
    return 10.0 / (1.0 - q)


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' ``histogram_quantile`` over one histogram (cumulative counts by ascending upper bound, the last
    +Inf): linear interpolation inside the bucket holding the rank; the first bucket starts at 0 (if its bound is
    positive); a rank in the +Inf bucket gives the highest finite bound. None without observations."""
    if not buckets or not math.isinf(buckets[-1][0]):
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for i, (le, count) in enumerate(buckets):
        if count >= rank:
            if math.isinf(le):
                return buckets[i - 1][0] if i > 0 else None
            if i == 0 and le <= 0:
                return le
            if count == lower_count:
                return le
            # Prometheus' order of operations, so that the figures agree to the last bit
            return lower_bound + (le - lower_bound) * ((rank - lower_count) / (count - lower_count))
        lower_bound, lower_count = le, count
    return None


@dataclass
class DecayedHistogram:
    """Non-cumulative counts per bucket, decayed; ``bounds`` as vLLM's buckets (ascending, +Inf last)."""

    bounds: tuple[float, ...]
    counts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0.0] * len(self.bounds)

    @property
    def total(self) -> float:
        return sum(self.counts)

    def decay(self, factor: float) -> None:
        self.counts = [c * factor for c in self.counts]

    def add(self, increments: Sequence[float]) -> None:
        self.counts = [c + d for c, d in zip(self.counts, increments, strict=True)]

    def quantile(self, q: float) -> float | None:
        if self.total < needed(q):
            return None
        cumulative, running = [], 0.0
        for le, c in zip(self.bounds, self.counts, strict=True):
            running += c
            cumulative.append((le, running))
        return histogram_quantile(q, cumulative)


def _increments(counts: tuple[float, ...], before: tuple[float, ...]) -> list[float] | None:
    """Each bucket's own observations over an interval, from the cumulative counts at its end and its start; None
    when there is nothing to learn: a counter went down (vLLM restarted), no traffic (nothing ages either), or the
    buckets decrease along le (not a histogram)."""
    cumulative = [now - then for now, then in zip(counts, before, strict=True)]
    if any(d < 0 for d in cumulative) or cumulative[-1] <= 0:
        return None
    increments = [cumulative[0]] + [b - a for a, b in itertools.pairwise(cumulative)]
    return None if any(d < 0 for d in increments) else increments


@dataclass
class LatencyCurve:
    """One engine's latency by concurrency, for each kind of latency."""

    half_life: float = DEFAULT_HALF_LIFE
    bins: tuple[int, ...] = ()
    histograms: dict[tuple[str, int], DecayedHistogram] = field(default_factory=dict)
    _previous: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = field(default_factory=dict)

    def observe(
        self,
        histograms: Mapping[str, Buckets],
        concurrency: float | None,
        seconds: float,
        max_concurrency: float | None,
    ) -> None:
        """One interval: ``histograms`` kind -> cumulative buckets at its end; ``concurrency`` the mean running
        requests over it (None: unknown, nothing learned); ``seconds`` its length; ``max_concurrency`` the KV bound."""
        bins = bin_bounds(max_concurrency)
        if bins != self.bins:  # another cache, another range of concurrency: what was learned no longer maps
            self.bins, self.histograms = bins, {}
        for kind, buckets in histograms.items():
            bounds = tuple(le for le, _ in buckets)
            counts = tuple(c for _, c in buckets)
            before = self._previous.get(kind)
            self._previous[kind] = (bounds, counts)
            if before is None or concurrency is None:
                continue
            if before[0] != bounds:  # a new bucket layout: start that kind afresh
                for key in [k for k in self.histograms if k[0] == kind]:
                    del self.histograms[key]
                continue
            increments = _increments(counts, before[1])
            if increments is None:
                continue
            factor = 0.5 ** (seconds / self.half_life) if self.half_life > 0 else 1.0
            for key, hist in self.histograms.items():
                if key[0] == kind:
                    hist.decay(factor)
            target = self._bin(concurrency)
            hist = self.histograms.setdefault((kind, target), DecayedHistogram(bounds))
            hist.add(increments)

    def _bin(self, concurrency: float) -> int:
        return next((b for b in self.bins if concurrency <= b), self.bins[-1])

    def quantiles(self) -> dict[tuple[str, int, float], float]:
        """(kind, bin, q) -> seconds, where enough observations say so."""
        out = {}
        for (kind, b), hist in sorted(self.histograms.items()):
            for q in QUANTILES:
                v = hist.quantile(q)
                if v is not None:
                    out[(kind, b, q)] = v
        return out

    def observations(self) -> dict[tuple[str, int], float]:
        return {key: hist.total for key, hist in sorted(self.histograms.items())}


# --- latency objectives -------------------------------------------------------------------------------------------

_OBJECTIVE = re.compile(r"p(\d{1,2}(?:\.\d+)?)\s*<=\s*(\S+)")


@dataclass(frozen=True)
class Objective:
    """A latency objective: quantile ``q`` of ``kind`` at most ``seconds``."""

    kind: str
    q: float
    seconds: float

    def __str__(self) -> str:
        return f"{self.kind} p{self.q * 100:g}<={self.seconds * 1000:g}ms"


def parse_objective(kind: str, text: str) -> Objective:
    """``p99<=50ms`` -> Objective(kind, 0.99, 0.05). ValueError with the reason when it is not one."""
    m = _OBJECTIVE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not an objective like p99<=50ms or p90<=2s")
    q = float(m[1]) / 100
    if not 0 < q < 1:
        raise ValueError(f"{text!r}: the quantile must be between p0 and p100, exclusive")
    seconds = parse_duration(m[2])
    if seconds <= 0:
        raise ValueError(f"{text!r}: the latency must be positive")
    return Objective(kind, q, seconds)


@dataclass(frozen=True)
class SloBound:
    """The largest concurrency bin at which every objective holds with enough observations (``max_concurrency``),
    and whether a bin above it was seen to break one (``knee_observed``; if not, the figure is a lower bound)."""

    max_concurrency: int | None
    knee_observed: bool


def below_resolution(
    objectives: Sequence[Objective], histograms: Mapping[str, Buckets]
) -> list[tuple[Objective, float]]:
    """The objectives a histogram cannot resolve, each with the histogram's first bucket: a latency under the
    first upper bound (vLLM's inter-token histogram: 10 ms) is only known to be under it, so a quantile there is an
    interpolation, not a measurement, and the concurrency such an objective allows is noise."""
    found = []
    for o in objectives:
        buckets = histograms.get(o.kind)
        if buckets and o.seconds < buckets[0][0]:
            found.append((o, buckets[0][0]))
    return found


def slo_bound(curve: LatencyCurve, objectives: Sequence[Objective]) -> SloBound:
    if not objectives:
        return SloBound(None, False)
    best: int | None = None
    for b in curve.bins:
        verdicts = []
        for o in objectives:
            hist = curve.histograms.get((o.kind, b))
            v = hist.quantile(o.q) if hist is not None else None
            verdicts.append(None if v is None else v <= o.seconds)
        if any(v is False for v in verdicts):
            return SloBound(best, True)
        if all(v is True for v in verdicts):
            best = b
    return SloBound(best, False)


# --- context as a distribution --------------------------------------------------------------------------------------

PROMPT = "prompt"
GENERATION = "generation"
CONTEXT_QUANTILE = 0.9


@dataclass
class ContextTokens:
    """Finished requests' prompt and generation tokens (vLLM's ``request_prompt_tokens`` and
    ``request_generation_tokens`` histograms), their increases decayed as the latency curve's are. A request's
    context at its end is its prompt plus what it generated; the histograms are separate, so the p90 context is
    estimated as p90(prompt) + p90(generation): exact when long prompts get long answers, an overestimate (a
    conservative capacity) otherwise."""

    half_life: float = DEFAULT_HALF_LIFE
    histograms: dict[str, DecayedHistogram] = field(default_factory=dict)
    _previous: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = field(default_factory=dict)

    def observe(self, histograms: Mapping[str, Buckets], seconds: float) -> None:
        for kind, buckets in histograms.items():
            bounds = tuple(le for le, _ in buckets)
            counts = tuple(c for _, c in buckets)
            before = self._previous.get(kind)
            self._previous[kind] = (bounds, counts)
            if before is None:
                continue
            if before[0] != bounds:
                self.histograms.pop(kind, None)
                continue
            cumulative = [now - then for now, then in zip(counts, before[1], strict=True)]
            if any(d < 0 for d in cumulative) or cumulative[-1] <= 0:
                continue
            increments = [cumulative[0]] + [b - a for a, b in itertools.pairwise(cumulative)]
            if any(d < 0 for d in increments):
                continue
            hist = self.histograms.get(kind)
            if hist is None:
                hist = self.histograms[kind] = DecayedHistogram(bounds)
            else:
                hist.decay(0.5 ** (seconds / self.half_life) if self.half_life > 0 else 1.0)
            hist.add(increments)

    def quantile(self, q: float = CONTEXT_QUANTILE) -> float | None:
        """p(q) of prompt + p(q) of generation tokens, once both are known."""
        parts = [self.histograms[k].quantile(q) if k in self.histograms else None for k in (PROMPT, GENERATION)]
        if any(p is None for p in parts):
            return None
        return sum(p for p in parts if p is not None)
