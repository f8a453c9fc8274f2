"""The sweep's report: the seed's table in text (concurrency, TTFT and TPOT p50/p99, throughput, vLLM's KV cache and
queue, the limit), then the knee, its evidence and the levers; JSON (its schema: docs/sweep.md) and CSV (a row a
step)."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from vllm_capacity.cli.sweep_config import SweepConfig
from vllm_capacity.levers.advice import Lever
from vllm_capacity.sweep.budget import MemoryBudget
from vllm_capacity.sweep.run import KINDS, QUANTILES, Step, Sweep

SCHEMA = 1  # the JSON's "schema": raised when a field changes meaning or goes


def _q(q: float) -> str:
    return f"p{q * 100:g}"


def step_doc(step: Step) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "concurrency": step.concurrency,
        "requests": step.requests,
        "errors": step.errors,
        "seconds": round(step.seconds, 3),
        **{f"{kind}_seconds": {_q(q): step.latency[kind][q] for q in QUANTILES} for kind in KINDS},
        "output_tokens_per_second": step.output_tokens_per_second,
        "total_tokens_per_second": step.total_tokens_per_second,
        "requests_per_second": step.requests_per_second,
        "kv_cache_capacity_tokens": step.kv_cache_capacity_tokens,
        "kv_cache_used_tokens_max": step.kv_cache_used_tokens_max,
        "kv_cache_used_tokens_mean": step.kv_cache_used_tokens_mean,
        "kv_cache_usage_ratio_max": step.kv_cache_usage_max,
        "requests_running_max": step.requests_running_max,
        "requests_waiting_max": step.requests_waiting_max,
        "requests_waiting_for_capacity_max": step.waiting_for_capacity_max,
        "preemptions": step.preemptions,
        "requests_shed": step.shed,
        "metrics_reads": step.reads,
        "limit": step.binding.limit if step.binding else None,
        "limit_share": step.binding.share if step.binding else None,
        "limit_evidence": step.binding.evidence if step.binding else None,
        "failed": step.failed,
    }
    return doc


def render_json(
    result: Sweep, found: list[Lever], values: SweepConfig, model: str, budget: MemoryBudget | None = None
) -> str:
    knee = result.knee
    doc = {
        "schema": SCHEMA,
        "model_name": model,
        "prompt_tokens": values.prompt_tokens,
        "max_tokens": values.max_tokens,
        "objectives": [str(o) for o in (values.slo_ttft, values.slo_itl) if o is not None],
        "interrupted": result.interrupted,
        "steps": [step_doc(s) for s in result.steps],
        "knee": {
            "concurrency": knee.concurrency,
            "limit": knee.limit,
            "evidence": knee.evidence,
            "reason": knee.reason,
        },
        "levers": [{"flag": lever.flag, "value": lever.value, "effect": lever.effect} for lever in found],
        "memory_budget": None if budget is None else _budget_doc(budget),
    }
    return json.dumps(doc, indent=2) + "\n"


CSV_COLUMNS = (
    "concurrency", "requests", "errors", "seconds",
    *(f"{kind}_{_q(q)}_seconds" for kind in KINDS for q in QUANTILES),
    "output_tokens_per_second", "total_tokens_per_second", "requests_per_second", "kv_cache_capacity_tokens",
    "kv_cache_used_tokens_max", "kv_cache_usage_ratio_max", "requests_running_max", "requests_waiting_max",
    "preemptions", "requests_shed", "limit", "failed",
)  # fmt: skip


def render_csv(
    result: Sweep, found: list[Lever], values: SweepConfig, model: str, budget: MemoryBudget | None = None
) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for step in result.steps:
        doc = step_doc(step)
        flat = {**doc, "errors": sum(step.errors.values())}
        for kind in KINDS:
            for q in QUANTILES:
                flat[f"{kind}_{_q(q)}_seconds"] = step.latency[kind][q]
        writer.writerow(["" if flat.get(c) is None else flat[c] for c in CSV_COLUMNS])
    return out.getvalue()


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def render_text(
    result: Sweep, found: list[Lever], values: SweepConfig, model: str, budget: MemoryBudget | None = None
) -> str:
    head = ("conc", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "out tok/s", "req/s", "KV used max",
            "KV tokens", "waiting", "preempt", "limit")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for s in result.steps:
        if s.failed is not None:
            rows.append((str(s.concurrency), "failed", *("",) * (len(head) - 3), s.failed[:60]))
            continue
        rows.append((
            str(s.concurrency), _ms(s.latency["ttft"][0.5]), _ms(s.latency["ttft"][0.99]),
            _ms(s.latency["tpot"][0.5]), _ms(s.latency["tpot"][0.99]), f"{s.output_tokens_per_second:,.1f}",
            f"{s.requests_per_second:.2f}", _n(s.kv_cache_used_tokens_max), _n(s.kv_cache_capacity_tokens),
            _n(s.requests_waiting_max), _n(s.preemptions), s.binding.limit if s.binding else "-",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        f"vllm-capacity sweep · {model} · prompts of {values.prompt_tokens:,} tokens, {values.max_tokens:,} out "
        "(latency in ms)",
        "",
        *(_row(r, widths) for r in rows),
        "",
    ]  # fmt: skip
    knee = result.knee
    if knee.concurrency is None:
        lines.append(f"Knee: none ({knee.reason})")
    else:
        lines.append(f"Knee: concurrency {knee.concurrency}, limit {knee.limit or 'unknown'}: {knee.reason}")
    if knee.evidence:
        lines.append(f"  evidence: {knee.evidence}")
    if found:
        lines += ["", "What would move it"]
        lines += [f"  {lever.flag} {lever.value}: {lever.effect}" for lever in found]
    elif knee.limit in ("none", "unknown", None):
        lines += ["", "What would move it: no flag; the limit found is not one vLLM's flags set"]
    if budget is not None:
        lines += ["", *_budget_lines(budget)]
    if result.interrupted:
        lines += ["", "Interrupted: the steps above finished; the rest did not run."]
    return "\n".join(lines) + "\n"


BUDGET_WORDS = {"weights": "weights", "kv_cache": "KV cache", "cuda_graphs": "CUDA graphs",
                "activation_peak": "activation peak"}  # fmt: skip


def _budget_doc(budget: MemoryBudget) -> dict[str, Any]:
    return {
        "source": budget.path,
        **{f"{part}_bytes": value for part, value in budget.parts().items()},
        "budget_bytes": budget.budget_bytes,
        "error": budget.error,
    }


def _budget_lines(budget: MemoryBudget) -> list[str]:
    """The memory budget in words: each part the log gives, and those it does not."""
    if budget.error is not None:
        return [f"Memory budget: not read: {budget.error}"]
    known = [f"{BUDGET_WORDS[p]} {v / 2**30:.2f} GiB" for p, v in budget.parts().items() if v is not None]
    missing = [BUDGET_WORDS[p] for p, v in budget.parts().items() if v is None]
    lines = [f"Memory budget per GPU rank (vLLM's start-up log): {', '.join(known)}"]
    if budget.budget_bytes is not None:
        lines.append(f"  of vLLM's budget {budget.budget_bytes / 2**30:.2f} GiB (total x gpu_memory_utilization)")
    if missing:
        lines.append(f"  not in the log: {', '.join(missing)}")
    return lines


def render(
    fmt: str, result: Sweep, found: list[Lever], values: SweepConfig, model: str, budget: MemoryBudget | None = None
) -> str:
    if fmt == "html":
        from vllm_capacity.cli.sweep_html import render_html

        return render_html(result, values, model, render_text(result, found, values, model, budget))
    return {"json": render_json, "csv": render_csv}.get(fmt, render_text)(result, found, values, model, budget)
