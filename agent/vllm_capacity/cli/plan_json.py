"""`vllm-capacity plan --format json`: one plan as one JSON document, for a script (its schema: docs/planning.md)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from vllm_capacity.cli.plan import memory_notes
from vllm_capacity.geometry import Geometry
from vllm_capacity.sizing import KvPlan, MemoryBudget, PlanInputs
from vllm_capacity.units import CONTEXTS

_BUDGET_KEYS = (
    "gpu_memory_bytes", "gpu_memory_utilization", "budget_bytes", "weights_bytes", "activation_bytes",
    "cuda_graph_bytes", "cuda_graphs_in_budget", "extensible_kv_cache", "extensible_margin_bytes", "not_given",
    "lora_bytes", "encoder_cache_bytes",
)  # fmt: skip


def _memory_budget(budget: MemoryBudget | None, kv_cache_bytes: float) -> dict[str, Any]:
    """The JSON's ``memory_budget``: the GPU's budget as planned (every key null without --gpu-memory), and the KV
    cache's bytes either way."""
    if budget is None:
        return {**dict.fromkeys(_BUDGET_KEYS), "kv_cache_bytes": kv_cache_bytes}
    return {
        "gpu_memory_bytes": budget.gpu_memory_bytes,
        "gpu_memory_utilization": budget.gpu_memory_utilization,
        "budget_bytes": budget.budget_bytes,
        "weights_bytes": budget.weights_bytes,
        "activation_bytes": budget.activation_bytes,
        "cuda_graph_bytes": budget.cuda_graph_bytes,
        "cuda_graphs_in_budget": budget.graphs_in_budget,
        "extensible_kv_cache": budget.extensible,
        "extensible_margin_bytes": budget.margin_bytes if budget.extensible else None,
        "not_given": list(budget.not_given),
        "lora_bytes": budget.lora_bytes,
        "encoder_cache_bytes": budget.encoder_cache_bytes,
        "kv_cache_bytes": kv_cache_bytes,
    }


def render_json(plan: KvPlan, geometry: Geometry, inputs: PlanInputs, budget: MemoryBudget | None) -> str:
    doc = {
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "num_gpu_blocks": plan.num_gpu_blocks,
        "kv_cache_tokens": plan.kv_cache_tokens,
        "max_concurrency": plan.max_concurrency,
        "max_model_len": plan.max_model_len,
        "block_size": plan.block_size,
        "kv_layers_per_rank": plan.kv_layers_per_rank,
        "cpu_tier_tokens": plan.cpu_tier_tokens,
        "rules": plan.rules,
        "notes": [*plan.notes, *memory_notes(geometry, inputs, budget)],
        "groups": [
            {"kind": g.kind, "layers": g.layers, "blocks_per_request": g.blocks_per_request} for g in plan.groups
        ],
        "group_size": plan.group_size or None,
        "page_bytes": plan.page_bytes,
        "concurrency_at_context": {str(c): plan.concurrency_at(c) for c in CONTEXTS if c <= plan.max_model_len},
        "memory_budget": _memory_budget(budget, plan.kv_cache_memory_bytes),
        "geometry": asdict(geometry),
        "inputs": {k: v for k, v in asdict(inputs).items() if k != "kv_cache_memory_bytes"},
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
