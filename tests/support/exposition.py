"""An exposition's samples and values, as prometheus-client's parser reads them."""

from __future__ import annotations

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
