"""The limit that binds over a stretch of readings of a server under load (a sweep's step, an hour of traffic).

Each reading is vLLM's own gauges and counters at one moment, summed over a model's engines. Between two readings
the limit is named as the live agent names it (:func:`vllm_capacity.derive.concurrency_limit`: requests shed at the
door, preemptions, running at ``--max-num-seqs``, requests waiting on a nearly full KV cache, a full token budget
per step); the stretch's limit is the one named most often, or one named in :data:`PRESSING` of it or more;
``none`` when nothing waited; its evidence says how often and with what figures.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_capacity.derive.capacity import BUDGET_FILL_BINDS, Bounds, concurrency_limit
from vllm_capacity.derive.facts import ServerFlags

#: a limit named in this share of a stretch binds it, even where nothing waited for the rest (a step's KV pressure
#: grows as its requests grow; the reads before that name none)
PRESSING = 0.25


@dataclass(frozen=True)
class Reading:
    """One read of the server's /metrics during the load, a model's engines summed (None: vLLM did not say)."""

    at: float  # seconds, monotonic
    running: float | None = None
    waiting: float | None = None
    waiting_for_capacity: float | None = None
    kv_usage: float | None = None  # the fullest engine's KV-cache usage, 0-1
    kv_used_tokens: float | None = None
    kv_capacity_tokens: float | None = None
    preemptions_total: float | None = None  # vLLM's counter since it started
    shed_total: float | None = None  # requests its queue caps rejected, since it started
    step_tokens_sum: float | None = None  # vllm:iteration_tokens_total's sum
    steps_total: float | None = None  # and its count: the engine steps


@dataclass(frozen=True)
class Binding:
    """The limit named most often over the stretch (one of ``derive.LIMITS``, or ``unknown``), the share of the
    stretch it was named in, and its evidence in words and numbers."""

    limit: str
    share: float
    evidence: str
    preemptions: float = 0.0
    shed: float = 0.0


def _increase(before: float | None, after: float | None) -> float:
    """A counter's increase between two reads; a counter that went down (vLLM restarted) counts from zero."""
    if after is None:
        return 0.0
    if before is None or after < before:
        return after if before is not None else 0.0
    return after - before


def _fill(before: Reading, after: Reading, flags: ServerFlags) -> float | None:
    """The engine steps' mean size between two reads over --max-num-batched-tokens."""
    if not flags.max_num_batched_tokens:
        return None
    steps = _increase(before.steps_total, after.steps_total)
    tokens = _increase(before.step_tokens_sum, after.step_tokens_sum)
    return tokens / steps / flags.max_num_batched_tokens if steps > 0 else None


def limits_between(readings: Sequence[Reading], flags: ServerFlags) -> list[str | None]:
    """The limit named between each pair of consecutive readings (None: requests waited for a reason none names)."""
    named = []
    for before, after in itertools.pairwise(readings):
        named.append(
            concurrency_limit(
                running=after.running,
                waiting=after.waiting,
                waiting_for_capacity=after.waiting_for_capacity,
                preempted=_increase(before.preemptions_total, after.preemptions_total) > 0,
                usage=after.kv_usage,
                bounds=Bounds(
                    max_num_seqs=flags.max_num_seqs,
                    budget_fill=_fill(before, after, flags),
                    shedding=_increase(before.shed_total, after.shed_total) > 0,
                ),
            )
        )
    return named


def binding_limit(readings: Sequence[Reading], flags: ServerFlags) -> Binding:
    """The limit that binds most of the stretch, with its evidence ("KV cache 97 % full for 80 % of the step, 14
    preemptions"). ``unknown`` with fewer than two readings: nothing to compare."""
    named = limits_between(readings, flags)
    if not named:
        return Binding("unknown", 0.0, "fewer than two reads of vLLM's /metrics in the stretch")
    counts = Counter(n or "unknown" for n in named)
    pressing = [(n, c) for n, c in counts.most_common() if n != "none"]
    limit, count = pressing[0] if pressing and pressing[0][1] >= PRESSING * len(named) else counts.most_common(1)[0]
    preempted = _increase(readings[0].preemptions_total, readings[-1].preemptions_total)
    shed = _increase(readings[0].shed_total, readings[-1].shed_total)
    if preempted and limit in ("none", "unknown"):
        # vLLM preempted requests in the stretch: its KV cache ran out, however briefly the reads caught it (under
        # load its /metrics answers late, and a burst of preemptions falls between two reads)
        limit, count = "kv_cache", counts["kv_cache"]
    share = count / len(named)
    return Binding(limit, share, _evidence(limit, share, readings, flags, preempted, shed), preempted, shed)


def _evidence(
    limit: str, share: float, readings: Sequence[Reading], flags: ServerFlags, preempted: float, shed: float
) -> str:
    usage = [r.kv_usage for r in readings if r.kv_usage is not None]
    full = max(usage) if usage else None
    waiting = max((r.waiting or 0 for r in readings), default=0)
    running = max((r.running or 0 for r in readings), default=0)
    parts = [f"{limit} for {share:.0%} of the stretch"]
    if full is not None:
        nearly = sum(1 for u in usage if u >= 0.9) / len(usage)
        parts.append(f"KV cache {full:.0%} full at most, 90 % or more for {nearly:.0%} of the reads")
    parts.append(f"{running:.0f} running and {waiting:.0f} waiting at most")
    if preempted:
        parts.append(f"{preempted:.0f} preemption{'s' if preempted != 1 else ''}")
    if shed:
        parts.append(f"{shed:.0f} request{'s' if shed != 1 else ''} shed at the door")
    if limit == "max_num_seqs" and flags.max_num_seqs:
        parts.append(f"--max-num-seqs {flags.max_num_seqs}")
    if limit == "token_budget" and flags.max_num_batched_tokens:
        parts.append(
            f"steps at {BUDGET_FILL_BINDS:.0%} or more of --max-num-batched-tokens {flags.max_num_batched_tokens}"
        )
    return ", ".join(parts)
