"""`vllm-capacity report`: one snapshot for a person at a terminal (text; ``report_json`` renders it for a script)."""

from __future__ import annotations

from datetime import UTC, datetime

from vllm_capacity.derive import EngineCapacity
from vllm_capacity.derive.budget import COMPONENTS
from vllm_capacity.snapshot import Snapshot
from vllm_capacity.units import CONTEXTS, format_bytes


def _n(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "unknown"
    return f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value * 100:.1f} %"


def _bytes_per_token_lines(e: EngineCapacity) -> list[str]:
    methods = [
        ("cache_config", e.kv_bytes_per_token_cache_config, "kv_cache_memory_bytes / capacity"),
        ("startup_log", e.kv_bytes_per_token_startup_log, "the log's KV memory / KV tokens"),
        ("model_config", e.kv_bytes_per_token_model_config, "config.json geometry"),
    ]
    known = [(m, v, how) for m, v, how in methods if v is not None]
    if not known:
        return [f"  bytes per token  {'unknown':>12}   (needs --vllm-log or --model-config)"]
    return [f"  bytes per token  {format_bytes(v):>12}   ({how})" for _, v, how in known]


def _layout_lines(e: EngineCapacity) -> list[str]:
    """The planned groups (--model-config): the blocks a max_model_len request holds by layer kind, and whether
    vLLM's capacity agrees with the plan; a CPU tier when there is one."""
    lines = []
    if e.layout is not None:
        kinds = ", ".join(
            f"{kind} {e.layout.groups[kind]} x {blocks // e.layout.groups[kind]:,}"
            for kind, blocks in e.layout.blocks_per_request.items()
        )
        lines.append(
            f"  per request  {sum(e.layout.blocks_per_request.values()):>12,} blocks   ({kinds}: groups x blocks)"
        )
        if e.layout.mismatch:
            lines.append(
                f"  plan disagrees: {e.layout.planned_tokens:,} tokens planned from config.json ({e.layout.assumed})"
            )
    if e.cpu_capacity_tokens is not None:
        lines.append(f"  CPU tier     {e.cpu_capacity_tokens:>12,} tokens   (for prefix reuse, not concurrency)")
    return lines


def _memory_heading(device: str | None) -> str:
    if device == "CPU":  # the CPU backend: the figures are host memory, and there is no GPU rank
        return "Host memory of the CPU server (from vLLM's log)"
    if device is None:
        return "Memory per rank (from vLLM's log)"
    return f"Memory per {device} rank (from vLLM's log)"


def _memory_lines(e: EngineCapacity) -> list[str]:
    rows = [
        ("KV cache pool", e.kv_pool_bytes),
        ("model weights", e.weights_bytes),
        ("CUDA graphs", e.cuda_graph_bytes),
        ("activation peak", e.activation_peak_bytes),
    ]
    known = [(name, v) for name, v in rows if v is not None]
    if not known:
        return []
    lines = ["", _memory_heading(e.memory_device)] + [f"  {name:<16} {format_bytes(v):>12}" for name, v in known]
    if e.kv_sized_after_warmup:
        sized = "  the KV cache was sized after warm-up (vLLM 0.34's extensible KV cache"
        if e.kv_requested_budget_bytes is not None:
            sized += f", within the requested {format_bytes(e.kv_requested_budget_bytes)}"
        if e.kv_remapped_from_blocks is not None:
            sized += f"; remapped from the {e.kv_remapped_from_blocks:,} blocks warm-up had committed"
        lines.append(sized + ")")
    if e.kv_host_tier:
        lines.append("  the capacity counts the host tier too (vLLM's 'GPU + host KV cache size', HiSparse)")
    return lines


def _best_bytes_per_token(e: EngineCapacity) -> float | None:
    return next(
        (
            v
            for v in (
                e.kv_bytes_per_token_startup_log,
                e.kv_bytes_per_token_cache_config,
                e.kv_bytes_per_token_model_config,
            )
            if v is not None
        ),
        None,
    )


def _engine_text(e: EngineCapacity, snap: Snapshot) -> list[str]:
    cc = e.cache_info
    return [
        f"model {e.model_name} · engine {e.engine}",
        f"vLLM {snap.version or 'version unknown'} · metric schema {snap.schema} · "
        f"cache dtype {cc.get('cache_dtype', 'unknown')}",
        "",
        "KV cache",
        f"  capacity         {_n(e.capacity_tokens):>12} tokens"
        + (f"   ({e.blocks:,} blocks x {e.block_size} tokens)" if e.blocks and e.block_size else ""),
        *_bytes_per_token_lines(e),
        *_layout_lines(e),
        f"  used             {_n(e.used_tokens):>12} tokens   {_pct(e.usage_ratio)}",
        f"  free             {_n(e.free_tokens):>12} tokens",
        *_memory_lines(e),
        "",
        *_concurrency_lines(e),
        "",
        *_load_lines(e),
        *_lora_lines(e),
        *_spec_decode_lines(e),
        *_curve_lines(e),
    ]


def _concurrency_lines(e: EngineCapacity) -> list[str]:
    """Requests whose KV cache fits at once, by context length: max_model_len, the usual ones below it, the mean
    observed context, and what the latency objective allows."""
    bpt = _best_bytes_per_token(e)
    lines = [
        "Concurrency: requests whose KV cache fits at once",
        f"  {'context (tokens)':<28}{'max concurrency':>16}{'KV per request':>16}",
    ]
    rows: list[tuple[str, float | None, float | None]] = []
    if e.max_model_len:
        rows.append((f"max_model_len {e.max_model_len:,}", e.max_concurrency, e.max_model_len))
    longer = [c for c in CONTEXTS if e.max_model_len and c > e.max_model_len]
    rows += [(f"{c:,}", e.concurrency_at(c), c) for c in CONTEXTS if c not in longer]
    if e.mean_context_tokens:
        rows.append(
            (f"observed {e.mean_context_tokens:,.0f} (mean)", e.max_concurrency_observed, e.mean_context_tokens)
        )
    if e.latency.slo_max_concurrency is not None:
        rows.append(("latency objective", e.latency.slo_max_concurrency, None))
    if e.sustained is not None and e.sustained.level is not None:
        held = "held while queued" if e.sustained.observed else "most seen, no queue yet"
        rows.append((f"sustained ({held})", e.sustained.level, None))
    for label, conc, ctx in rows:
        kv = format_bytes(ctx * bpt) if (bpt and ctx) else "-"
        lines.append(f"  {label:<28}{_n(conc, 2) + 'x':>16}{kv:>16}")
    if longer:
        lines.append(f"  ({', '.join(f'{c:,}' for c in longer)}: longer than max_model_len, refused by vLLM)")
    return lines


def _load_lines(e: EngineCapacity) -> list[str]:
    """The engine's load: running against its bounds, the queue, preemptions, sleep, the limit and the headroom."""
    over = " (over 100 %: requests are shorter)" if (e.concurrency_utilization or 0) > 1 else ""
    waiting_detail = [
        f"{_n(v)} {what}"
        for v, what in ((e.waiting_for_capacity, "for capacity"), (e.waiting_deferred, "deferred"))
        if v is not None
    ]
    lines = [
        "Load",
        f"  running          {_n(e.running):>12}",
        f"    of max at max_model_len    {_pct(e.concurrency_utilization):>10}{over}",
        f"    of max at observed context {_pct(e.concurrency_utilization_observed):>10}",
        f"  waiting          {_n(e.waiting):>12}" + (f"   ({', '.join(waiting_detail)})" if waiting_detail else ""),
        f"  preemptions      {_n(e.preemptions_total):>12}   (total)",
    ]
    if e.asleep:
        lines.append("  asleep: vLLM's sleep mode freed the KV cache")
    if e.concurrency_limit is not None:
        lines.append(f"  limit now        {e.concurrency_limit:>12}")
    if e.headroom_requests is not None:
        why = _HEADROOM_WHY.get(e.headroom_basis or "", f"bound by {e.headroom_basis}")
        lines.append(f"  headroom         {_n(e.headroom_requests):>12} requests   ({why})")
    return lines


# what a headroom's basis means, said to a person (the model-based bases: "bound by <basis>")
_HEADROOM_WHY = {
    "queue": "requests wait: none left",
    "preemption": "vLLM just preempted: none left",
}


def _names(adapters: tuple[str, ...], most: int = 6) -> str:
    shown = ", ".join(adapters[:most]) or "-"
    return shown + (f" and {len(adapters) - most} more" if len(adapters) > most else "")


def _lora_lines(e: EngineCapacity) -> list[str]:
    """Multi-LoRA serving: vLLM's adapter slots, the adapters in its batch, and whether requests wait for a slot."""
    lora = e.lora
    if lora is None:
        return []
    waits: dict[bool | None, str] = {
        True: "requests wait for a slot that other adapters hold",
        False: "no request waits for a slot",
        None: "whether requests wait for a slot: unknown (vLLM gives no reason for waiting)",
    }
    return [
        "",
        "LoRA adapters",
        f"  slots            {_n(lora.slots):>12}   (--max-loras: adapters one batch serves)",
        f"  running          {len(lora.running):>12}   ({_names(lora.running)})",
        f"  {waits[lora.blocked]}",
    ]


def _spec_decode_lines(e: EngineCapacity) -> list[str]:
    """Speculative decoding's acceptance since vLLM started (its spec_decode_* counters), when it drafts."""
    sd = e.spec_decode
    if sd is None:
        return []
    length = sd.mean_acceptance_length
    return [
        "",
        "Speculative decoding (since vLLM started)",
        f"  accepted         {_pct(sd.acceptance_ratio):>12}   ({_n(sd.accepted_tokens)} of {_n(sd.draft_tokens)} "
        "draft tokens)",
        f"  tokens per step  {_n(length, 2):>12}   (mean acceptance length: 1 + accepted / drafts)"
        if length is not None
        else "  tokens per step       unknown   (vLLM counts no drafts before V1 0.8.5)",
    ]


def _curve_lines(e: EngineCapacity) -> list[str]:
    """The learned latency-by-concurrency curve (p50 / p90 / p99 inter-token latency by running requests), with
    the knee: the bin the SLO-bound concurrency stops at."""
    q = e.latency.quantiles
    bins = sorted({b for kind, b, _ in q if kind == "itl"})
    if not bins:
        return []
    out = [
        "",
        "Inter-token latency by running requests (learned)",
        f"  {'running':>9}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for b in bins:
        cells = "".join(
            f"{(q[('itl', b, x)] * 1000):>8.1f}ms" if ("itl", b, x) in q else f"{'-':>10}" for x in (0.5, 0.9, 0.99)
        )
        knee = "   <- the objective holds up to here" if b == e.latency.slo_max_concurrency else ""
        out.append(f"  {'<= ' + str(b):>9}{cells}{knee}")
    return out


_COMPONENT_NAMES = {
    "weights": "Model weights",
    "kv_cache": "KV cache",
    "vllm_runtime": "CUDA graphs, activations, context",
    "other_processes": "Other processes",
    "system": "Driver reserved / unattributed",
    "free": "Free",
}


def gpu_picture(snap: Snapshot) -> list[str]:
    """Each GPU's memory as a stack of what holds it, with vLLM's budget line."""
    lines: list[str] = []
    for g in snap.gpus:
        budget = snap.gpu_budgets.get(g.index)
        total = g.memory_total_bytes
        if total is None:  # a unified-memory GPU: no device memory to draw
            lines += ["", f"GPU {g.index} {g.name} ({g.uuid}): memory not reported (unified memory)"]
            continue
        lines += ["", f"GPU {g.index} {g.name} ({g.uuid}): {format_bytes(total)}"]
        if budget is None:
            continue
        width = 30  # bar width: the whole GPU
        rule = "  +" + "-" * (width + 50) + "+"
        lines.append(rule)
        for component in COMPONENTS:
            size = budget.components.get(component)
            if size is None:
                continue
            bar = "#" * round(size / total * width) if total else ""
            lines.append(f"  | {_COMPONENT_NAMES[component]:<34}{format_bytes(size):>12}  {bar:<{width}} |")
        lines.append(rule)
        missing = [_COMPONENT_NAMES[c] for c in COMPONENTS if c not in budget.components]
        if missing:
            lines.append(f"  unknown: {', '.join(missing)} (see docs/gpu-budget.md)")
        if budget.budget_bytes:
            lines.append(f"  vLLM's budget (gpu_memory_utilization): {format_bytes(budget.budget_bytes)}")
    return lines


def render_text(snap: Snapshot, url: str) -> str:
    when = datetime.fromtimestamp(snap.timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if snap.timestamp else ""
    out = [f"vLLM capacity report: {url}  {when}".rstrip(), ""]
    if not snap.engines:
        out.append("vLLM answered, but reported no engine with KV-cache metrics.")
    for i, e in enumerate(snap.engines):
        if i:
            out += ["", "-" * 72, ""]
        out += _engine_text(e, snap)
    out += gpu_picture(snap)
    return "\n".join(out) + "\n"
