"""`vllm-capacity report --format json`: one snapshot as one JSON document, for a script."""

from __future__ import annotations

import dataclasses
import json

from vllm_capacity.snapshot import Snapshot
from vllm_capacity.units import CONTEXTS

# report --format json keeps the keys it had before the record's fields got names that say what they are
JSON_NAMES = {
    "kv_bytes_per_token_cache_config": "kv_bytes_per_token",
    "concurrency_utilization": "utilization",
    "concurrency_utilization_observed": "utilization_observed",
    "kv_bytes_per_token_startup_log": "kv_bytes_per_token_log",
    "kv_bytes_per_token_model_config": "kv_bytes_per_token_model",
}


def _typed(text: str) -> object:
    """A cache_config_info label value as JSON would have it: a boolean, a number, or the text."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def render_json(snap: Snapshot, url: str) -> str:
    engines = []
    for e in snap.engines:
        d = dataclasses.asdict(e)
        cache_info, preemptions = d.pop("cache_info"), d.pop("preemptions_total")
        d.pop("latency")
        d["latency_by_concurrency"] = [
            {"latency": kind, "running": b, "quantile": q, "seconds": v}
            for (kind, b, q), v in sorted(e.latency.quantiles.items())
        ]
        d["slo_max_concurrency"] = e.latency.slo_max_concurrency
        d["sustained"] = None if e.sustained is None else {"level": e.sustained.level, "observed": e.sustained.observed}
        d = {JSON_NAMES.get(k, k): v for k, v in d.items()}
        d["concurrency_at_context"] = {str(c): e.concurrency_at(c) for c in CONTEXTS}
        d["preemptions_total"] = preemptions
        d["cache_config"] = {k: _typed(v) for k, v in cache_info.items()}
        if e.spec_decode is not None:
            d["spec_decode"] = {
                **d["spec_decode"],
                "acceptance_ratio": e.spec_decode.acceptance_ratio,
                "mean_acceptance_length": e.spec_decode.mean_acceptance_length,
            }
        engines.append(d)
    doc = {
        "vllm_url": url,
        "up": snap.up,
        "timestamp": snap.timestamp,
        "schema": snap.schema,
        "vllm_version": snap.version,
        "engines": engines,
        "gpus": [
            {
                **dataclasses.asdict(g),
                "memory_budget": dict(snap.gpu_budgets[g.index].components) if g.index in snap.gpu_budgets else None,
            }
            for g in snap.gpus
        ],
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
