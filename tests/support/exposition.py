"""An exposition's samples and values, as prometheus-client's parser reads them."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels), parsed by prometheus-client."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, metric: str, /, **labels: str) -> float | None:
    """The value of the one sample ``metric`` whose labels include ``labels``; None when absent."""
    found = [
        v
        for (n, lbls), v in samples(text).items()
        if n == metric and all(dict(lbls).get(k) == x for k, x in labels.items())
    ]
    assert len(found) <= 1, f"{metric} {labels}: {len(found)} samples"
    return found[0] if found else None


def plausible(name: str, labels: tuple[tuple[str, str], ...], v: float) -> bool:
    """Whether a sample of the agent's could be right: finite, and not negative, except headroom, which is minus
    the queue while requests wait (basis queue) and below zero past a bound (basis slo, sustained, ...)."""
    if name == "vllm_capacity_headroom_requests":
        return math.isfinite(v)
    return math.isfinite(v) and (v >= 0 or name.endswith("_created"))
