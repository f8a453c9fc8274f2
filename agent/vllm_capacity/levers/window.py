"""The records of ``advise``'s rules: each figure read from Prometheus with the PromQL and time that re-read it, one
deployment's figures over the window, what the operator asked, and the findings (a recommendation, or why none);
with the helpers every rule uses (the release, the block size, the planner's plan of the deployment's pool)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_capacity import sizing
from vllm_capacity.geometry import Geometry


@dataclass(frozen=True)
class Figure:
    """One figure read from Prometheus: its value (None: no data), the PromQL and when it was evaluated (a range
    query: ``start``, ``end`` and ``step`` too)."""

    value: float | None
    promql: str
    at: float
    start: float | None = None
    step: float | None = None

    def __bool__(self) -> bool:
        return self.value is not None and not math.isnan(self.value)


NO_FIGURE = Figure(None, "", 0.0)


@dataclass(frozen=True)
class Observed:
    """One model's deployment over the window, as Prometheus holds it (a Figure per reading, NO_FIGURE where no
    series answered); ``info`` the vllm_info labels (version, cache_dtype, block_size, gpu_memory_utilization);
    ``hours`` the hourly preemptions and demand (timestamp -> value)."""

    group: Mapping[str, str]  # cluster, namespace, model_name
    window: str
    figures: Mapping[str, Figure]
    info: Mapping[str, str] = field(default_factory=dict)
    preempted_hours: Mapping[float, float] = field(default_factory=dict)
    demand_hours: Mapping[float, float] = field(default_factory=dict)
    hours: Figure = NO_FIGURE  # the range queries behind the two above

    def get(self, name: str) -> Figure:
        return self.figures.get(name, NO_FIGURE)

    def value(self, name: str) -> float | None:
        f = self.get(name)
        return f.value if f else None


@dataclass(frozen=True)
class Asked:
    """What the operator gave advise: the headroom kept at the peak, and the model (--model-config, --tp)."""

    headroom: float = 0.2
    geometry: Geometry | None = None
    tp: int = 1


@dataclass(frozen=True)
class Recommendation:
    """A flag in vLLM's spelling (or ``replicas``), its value now and the value advised, what that buys in numbers,
    the figures it rests on and the rule applied."""

    flag: str
    current: str
    advised: str
    effect: str
    evidence: tuple[Figure, ...]
    rule: str
    numbers: Mapping[str, float] = field(default_factory=dict)  # the effect's figures, for a script


@dataclass(frozen=True)
class NotAdvised:
    """A question the figures answer with "nothing to change", or cannot answer (``gap``: what is missing)."""

    flag: str
    reason: str
    gap: bool = False


Finding = Recommendation | NotAdvised


def release(o: Observed) -> sizing.Version | None:
    try:
        return sizing.parse_version(o.info.get("version", ""))
    except ValueError:
        return None


def block_size(o: Observed) -> int:
    text = o.info.get("block_size", "")
    return int(text) if text.isdigit() else 16


def plan_of(o: Observed, asked: Asked, **over: Any) -> sizing.KvPlan | None:
    """The planner's plan of this deployment's pool (kv_cache_pool_bytes) with ``over`` changed; None without the
    model's config, the pool or its release, or where the planner does not size it."""
    pool, mml, version = o.value("pool_bytes"), o.value("max_model_len"), release(o)
    if asked.geometry is None or not pool or not mml or version is None:
        return None
    inputs = sizing.PlanInputs(
        kv_cache_memory_bytes=int(pool),
        max_model_len=int(mml),
        tp=asked.tp,
        kv_cache_dtype=o.info.get("cache_dtype") or "auto",
        block_size=block_size(o),
        version=version,
    )
    try:
        return sizing.plan(asked.geometry, replace(inputs, **over))
    except (ValueError, sizing.NotModelled, sizing.ImpossiblePlan):
        return None
