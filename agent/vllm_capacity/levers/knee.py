"""The knee of a concurrency sweep: the largest concurrency whose latency objectives hold, or without objectives the
last concurrency before a doubling adds under :data:`GAIN` of throughput (the seed's "the sweet spot is just before
the latency curve bends").
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_capacity.derive.latency_curve import Objective
from vllm_capacity.levers.limits import Binding

GAIN = 0.10  # a doubling of concurrency that adds less output throughput than this is past the knee


@dataclass(frozen=True)
class StepFigures:
    """What the knee reads of one finished step: its concurrency, output tokens/s, latency quantiles by kind
    (``ttft``, ``tpot``, ``itl``, ``e2e`` -> {0.5: seconds, 0.9: ..., 0.99: ...}), and the limit that bound it."""

    concurrency: int
    output_tokens_per_second: float
    latency: Mapping[str, Mapping[float, float | None]]
    binding: Binding | None = None
    failed: str | None = None  # why the step failed (vLLM went away): it has no figures


@dataclass(frozen=True)
class Knee:
    """The knee's concurrency (None: no step finished), the limit that binds there, why this step is the knee."""

    concurrency: int | None
    limit: str | None
    evidence: str
    reason: str


def broken(step: StepFigures, objectives: Sequence[Objective]) -> list[str]:
    """The objectives ``step`` breaks, as people write them ("itl p99 61 ms > 50 ms"); an objective whose quantile
    the step could not measure is not counted as broken."""
    out = []
    for o in objectives:
        seen = step.latency.get(o.kind, {}).get(o.q)
        if seen is not None and seen > o.seconds:
            out.append(f"{o.kind} p{o.q * 100:g} {seen * 1000:.0f} ms > {o.seconds * 1000:g} ms")
    return out


def find_knee(steps: Sequence[StepFigures], objectives: Sequence[Objective]) -> Knee:
    """The knee of the finished steps, the limit that binds just past it (where the objective breaks, or where
    throughput stops growing), and why."""
    done = sorted((s for s in steps if s.failed is None), key=lambda s: s.concurrency)
    if not done:
        return Knee(None, None, "", "no step finished")
    if objectives:
        holding = [s for s in done if not broken(s, objectives)]
        if not holding:
            first = done[0]
            return Knee(
                None,
                _limit(first),
                _evidence(first),
                f"every step breaks the objective: {'; '.join(broken(first, objectives))}",
            )
        knee = holding[-1]
        above = next((s for s in done if s.concurrency > knee.concurrency), None)
        if above is None or not broken(above, objectives):
            reason = "the largest concurrency swept, and every objective holds there: the knee may lie beyond it"
            return Knee(knee.concurrency, _limit(knee), _evidence(knee), reason)
        reason = f"the largest concurrency whose objectives hold; at {above.concurrency}: "
        return Knee(knee.concurrency, _limit(above), _evidence(above), reason + "; ".join(broken(above, objectives)))
    for step, doubled in itertools.pairwise(done):
        if step.output_tokens_per_second > 0:
            gain = doubled.output_tokens_per_second / step.output_tokens_per_second - 1
            if gain < GAIN * (doubled.concurrency / step.concurrency) / 2:
                return Knee(
                    step.concurrency,
                    _limit(doubled),
                    _evidence(doubled),
                    f"{step.concurrency} -> {doubled.concurrency} adds {gain:+.0%} output tokens/s "
                    f"(under {GAIN:.0%} a doubling): the latency bends past here",
                )
    last = done[-1]
    return Knee(
        last.concurrency,
        _limit(last),
        _evidence(last),
        "throughput still grew at the largest concurrency swept: the knee may lie beyond it",
    )


def _limit(step: StepFigures) -> str | None:
    return step.binding.limit if step.binding is not None else None


def _evidence(step: StepFigures) -> str:
    return f"at {step.concurrency}: {step.binding.evidence}" if step.binding is not None else ""
