"""`vllm-capacity plan` given several values of a flag (``--tp 1,2 --kv-cache-dtype auto,fp8``): one plan of every
combination, side by side, each the single-value plan of its flags (the same assemble, the same planner)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from typing import Any

from vllm_capacity import sizing
from vllm_capacity.cli import plan_inputs
from vllm_capacity.cli.configs import PlanConfig
from vllm_capacity.cli.options import UsageError
from vllm_capacity.geometry import GeometryError
from vllm_capacity.sources.model_config import model_dir_weights_bytes
from vllm_capacity.units import format_bytes

#: the "typical context" column: the seed's 8K (208,625 tokens hold about 25 requests of 8,192)
TYPICAL_CONTEXT = 8192
#: how each compared flag is spelled on the command line and in the table
FLAG = {
    "tp": "--tp",
    "kv_cache_dtype": "--kv-cache-dtype",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
}
MOST_COMBINATIONS = 256


@dataclass(frozen=True)
class Cell:
    """One combination's plan, or why there is none (``refused``: vLLM would refuse it, or it does not fit)."""

    flags: dict[str, Any]
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_model_len: int | None = None
    concurrency_at_typical: float | None = None
    weights_bytes_per_gpu: int | None = None
    gpus_per_replica: int = 1
    refused: str | None = None


def combinations(values: PlanConfig) -> list[PlanConfig]:
    """Every combination of the compared flags' values, as the single-value configuration ``plan`` would read.
    Raises UsageError where a comparison would mislead."""
    keys = [key for key, _ in values.compared]
    if "tp" in keys and values.weights_memory is not None:
        raise UsageError(
            "--tp with several values and --weights-memory: that figure is one rank's weights, which differ by TP; "
            "give --model-dir (weights from its headers, divided over the ranks) or one --tp at a time"
        )
    if "gpu_memory_utilization" in keys and values.gpu_memory is None:
        raise UsageError("--gpu-memory-utilization with several values needs --gpu-memory (the budget it scales)")
    product = list(itertools.product(*(given for _, given in values.compared)))
    if len(product) > MOST_COMBINATIONS:
        raise UsageError(f"{len(product):,} combinations: at most {MOST_COMBINATIONS} in one table")
    return [replace(values, compared=(), **dict(zip(keys, combo, strict=True))) for combo in product]


def cell(values: PlanConfig, keys: list[str]) -> Cell:
    """The plan of one combination, as ``plan`` with those single values gives it."""
    flags = {key: getattr(values, key) for key in keys}
    try:
        geometry, inputs, budget = plan_inputs.assemble(values)
        plan = sizing.plan(geometry, inputs)
    except (plan_inputs.MissingInput, GeometryError, sizing.NotModelled, sizing.ImpossiblePlan, ValueError) as err:
        return Cell(flags, gpus_per_replica=values.tp * values.pp, refused=str(err))
    weights = budget.weights_bytes if budget is not None else None
    if weights is None and values.model_dir_path is not None:
        weights = model_dir_weights_bytes(values.model_dir_path) // (values.tp * values.pp)
    typical = plan.concurrency_at(TYPICAL_CONTEXT) if plan.max_model_len >= TYPICAL_CONTEXT else None
    return Cell(
        flags,
        kv_cache_tokens=plan.kv_cache_tokens,
        max_concurrency=plan.max_concurrency,
        max_model_len=plan.max_model_len,
        concurrency_at_typical=typical,
        weights_bytes_per_gpu=weights,
        gpus_per_replica=values.tp * values.pp,
    )


def compare(values: PlanConfig) -> tuple[list[str], list[Cell]]:
    """The compared flags and one cell per combination, in the order the values were given."""
    keys = [key for key, _ in values.compared]
    return keys, [cell(each, keys) for each in combinations(values)]


def render_text(keys: list[str], cells: list[Cell]) -> str:
    head = [FLAG[k] for k in keys] + ["KV tokens", "max conc @ max_model_len", f"@ {TYPICAL_CONTEXT:,}",
                                      "weights / GPU", "GPUs / replica"]  # fmt: skip
    rows: list[tuple[list[str], str | None]] = [(head, None)]  # each row's columns, or its flags and why refused
    for c in cells:
        flags = [str(c.flags[k]) for k in keys]
        if c.refused is not None or c.kv_cache_tokens is None or c.max_concurrency is None:
            rows.append((flags, f"refused: {c.refused}"))
            continue
        typical = f"{c.concurrency_at_typical:.2f}x" if c.concurrency_at_typical is not None else "-"
        weights = format_bytes(c.weights_bytes_per_gpu) if c.weights_bytes_per_gpu is not None else "-"
        rows.append(([*flags, f"{c.kv_cache_tokens:,}", f"{c.max_concurrency:.2f}x at {c.max_model_len:,}", typical,
                      weights, str(c.gpus_per_replica)], None))  # fmt: skip
    widths = [max(len(cols[i]) for cols, _ in rows if i < len(cols)) for i in range(len(head))]
    lines = []
    for cols, refused in rows:
        cells_text = [
            v.ljust(w) if i < len(keys) else v.rjust(w)
            for i, (v, w) in enumerate(zip(cols, widths[: len(cols)], strict=True))
        ]
        lines.append("  ".join(cells_text + ([refused] if refused else [])).rstrip())
    title = f"vllm-capacity plan: {len(cells)} combinations of {', '.join(FLAG[k] for k in keys)}"
    return "\n".join([title, "", *lines]) + "\n"


def render_json(keys: list[str], cells: list[Cell]) -> str:
    doc = {
        "compared": keys,
        "typical_context": TYPICAL_CONTEXT,
        "plans": [
            {
                **c.flags,
                "kv_cache_tokens": c.kv_cache_tokens,
                "max_concurrency": c.max_concurrency,
                "planned_max_model_len": c.max_model_len,
                "concurrency_at_typical_context": c.concurrency_at_typical,
                "weights_bytes_per_gpu": c.weights_bytes_per_gpu,
                "gpus_per_replica": c.gpus_per_replica,
                "refused": c.refused,
            }
            for c in cells
        ],
    }
    return json.dumps(doc, indent=2) + "\n"
