"""`vllm-capacity plan`: vLLM's capacity math offline, from a model's config.json, for people (JSON: ``plan_json``)."""

from __future__ import annotations

from dataclasses import replace

from vllm_capacity import sizing
from vllm_capacity.cli.plan_inputs import encoder_bytes, lora_bytes
from vllm_capacity.geometry import Geometry
from vllm_capacity.sizing import KvPlan, MemoryBudget, NotModelled, PlanInputs, kv_dtype_bytes
from vllm_capacity.sizing.lora import EMBEDDING_SLOTS
from vllm_capacity.sizing.memory import SAMPLER_PEAK_LOGIT_COPIES
from vllm_capacity.sizing.versions import EXTENSIBLE_KV_CACHE, MLA_LATENT_CACHE, dotted
from vllm_capacity.units import CONTEXTS, format_bytes


def memory_notes(geometry: Geometry, inputs: PlanInputs, budget: MemoryBudget | None) -> list[str]:
    """The figures beside the KV cache that the plan took from vLLM's options, each with where it comes from: the
    budget's own rows where there is a budget, so that a note never differs from its row."""
    notes = []
    if inputs.tp > 1 and budget is None:
        notes.append(
            f"TP {inputs.tp}: vLLM sizes every rank's KV cache to the smallest rank's free memory, so one worker's "
            "log line can say more than the engine uses: give the smallest of the ranks' figures (or the engine's "
            "'GPU KV cache size', which is already the smallest)"
        )
    if budget is None and inputs.version >= EXTENSIBLE_KV_CACHE:
        notes.append(
            f"vLLM {dotted(inputs.version)} sizes the KV cache after warm-up on CUDA and ROCm (the extensible KV "
            "cache): its 'Available KV cache memory' is the estimate before warm-up, so give --kv-cache-memory from "
            "'Extended KV cache to N blocks (X GiB)' (or the 'N KV cache blocks (X GiB) fit within the requested X "
            "GiB' of its 'Memory after warmup' line, without the granules' rounding); without the extensible cache "
            "(--kv-cache-memory-bytes, --num-gpu-blocks-override, another platform) 'Available KV cache memory' is "
            "still the pool"
        )
    if budget is not None and budget.extensible:
        notes.append(_extensible_note(budget))
    if inputs.lora is not None:
        notes.append(_lora_note(geometry, inputs, budget))
    return notes + _encoder_notes(geometry, inputs, budget) + _unmeasured_notes(budget)


def _extensible_note(budget: MemoryBudget) -> str:
    """How 0.34's extensible KV cache sized this plan, and what vLLM says of an explicit utilization below 1."""
    note = (
        "Extensible KV cache (vLLM 0.34 on CUDA and ROCm): sized after warm-up and graph capture from the memory "
        "measured then (measure_kv_cache_bytes): the budget less what the engine holds (weights, LoRA slots, CUDA "
        "graphs), at most the GPU's free memory less a margin of "
        f"{format_bytes(budget.margin_bytes)} (max({format_bytes(budget.margin_floor_bytes)}, 0.75 x the "
        "transient peak)), less the transient peak kept free; the GPU's memory is taken as free at start (other "
        "processes and the CUDA context not counted). Its log lines: 'Memory after warmup: X GiB free' and 'Extended "
        "KV cache to N blocks (X GiB)'"
    )
    if 0.7 < budget.gpu_memory_utilization < 1.0:
        note += (
            f"; gpu_memory_utilization {budget.gpu_memory_utilization:g} caps it, and vLLM warns when that keeps 1 GiB "
            "or more out of the KV cache: leave it unset (1.0) unless it leaves room for memory vLLM does not "
            "measure (other processes on the GPU, weight-transfer buffers, a KV connector's buffers)"
        )
    return note


def _unmeasured_notes(budget: MemoryBudget | None) -> list[str]:
    """What the budget estimated or took as 0 because nobody gave it, and where the CUDA graphs are: never a silent
    figure."""
    if budget is None:
        return []
    notes = []
    if "activations" in budget.not_given:
        line = "'PyTorch activation peak memory takes X GiB' ('torch peak memory increase: X GiB' in V1's DEBUG line)"
        if budget.activation_bytes:
            notes.append(
                f"Activation peak not given: estimated at {format_bytes(budget.activation_bytes)}, V1's sampler "
                f"warm-up over --max-num-seqs requests ({SAMPLER_PEAK_LOGIT_COPIES:g} fp32 copies of their logits "
                "over the vocabulary; within 1 % of the peaks vLLM 0.10.2 and 0.11 logged for three models). "
                f"--activation-memory from vLLM's {line} settles it"
            )
        else:
            notes.append(
                "Activation peak not given and not estimated (V0's profile, or a config.json without the "
                "vocabulary): taken as 0, so the KV cache above is an upper bound (vLLM's logged start-ups spent "
                f"1.2-7.4 GiB on it). Give --activation-memory from vLLM's {line}"
            )
    if not budget.graphs_in_budget:
        notes.append(
            "CUDA graphs: this vLLM captures them after sizing the KV cache, in the memory outside "
            "gpu_memory_utilization's budget (from 0.20 it subtracts its 'Estimated CUDA graph memory' first): "
            "they do not change the KV cache"
        )
    elif "CUDA graphs" in budget.not_given and budget.extensible:
        notes.append(
            "CUDA graphs taken as 0 (not given; the extensible KV cache measures them after capturing them): the KV "
            "cache above is an upper bound (vLLM's logged start-ups spent 0.1-3.5 GiB on them). Give "
            "--cuda-graph-memory from vLLM's 'Graph capturing finished in N secs, took X GiB' (0 with "
            "--enforce-eager); or plan from --kv-cache-memory ('Extended KV cache to N blocks (X GiB)')"
        )
    elif "CUDA graphs" in budget.not_given:
        notes.append(
            "CUDA graphs taken as 0 (not given; vLLM measures them by capturing two graphs on the GPU): the KV "
            "cache above is an upper bound (vLLM's logged start-ups spent 0.1-3.5 GiB on them). Give "
            "--cuda-graph-memory from vLLM's 'Estimated CUDA graph memory: X GiB total' (0 with --enforce-eager); "
            "or plan from --kv-cache-memory (vLLM's 'Available KV cache memory')"
        )
    return notes


def _lora_note(geometry: Geometry, inputs: PlanInputs, budget: MemoryBudget | None) -> str:
    assert inputs.lora is not None
    slots = f"{inputs.lora.max_loras} adapter slot{'s' if inputs.lora.max_loras > 1 else ''} of rank "
    slots += str(inputs.lora.max_rank)
    if budget is not None:
        size = budget.lora_bytes
        where = "in the budget on top of the weights (give --weights-memory as the weights alone)"
    else:
        where = "already outside the KV memory given: vLLM's figure is what is left after them"
        try:
            size = lora_bytes(geometry, inputs.lora, tp=inputs.tp, pp=inputs.pp, version=inputs.version)
        except NotModelled as err:  # outside the measured figure, their size does not change the plan
            return f"LoRA: {slots}: {where}; their size is not modelled here: {err}"
    layers = f"every linear layer{' and the embeddings' if EMBEDDING_SLOTS.get(geometry.architecture) else ''}"
    return (
        f"LoRA: {slots} in {geometry.dtype} on {layers}: {format_bytes(size)} per GPU, preallocated when vLLM loads "
        f"the model (counted in its 'Model loading took' figure); {where}"
    )


def _encoder_notes(geometry: Geometry, inputs: PlanInputs, budget: MemoryBudget | None) -> list[str]:
    notes = []
    if inputs.encoder_cache_tokens is not None and geometry.multimodal is not None:
        size = (
            budget.encoder_cache_bytes
            if budget is not None
            else encoder_bytes(geometry, inputs.encoder_cache_tokens, budgeted=False, version=inputs.version)
        )
        notes.append(
            f"Multimodal encoder cache: {inputs.encoder_cache_tokens:,} tokens (vLLM's logged budget) x "
            f"{geometry.encoder_width} per token x {kv_dtype_bytes('auto', geometry.dtype)} B = "
            f"{format_bytes(size)}, held while vLLM profiles its memory (its dummy items fill the budget to within "
            "one item); "
            + (
                "the encoder's own activations are part of --activation-memory"
                if budget is not None
                else "already outside the KV memory given"
            )
        )
    return notes


def budget_picture(budget: MemoryBudget, kv_bytes: int, width: int = 46) -> list[str]:
    """The GPU's memory as a stack of what it holds, with the part outside vLLM's budget."""
    rows = [
        ("Model weights", budget.weights_bytes),
        ("LoRA slots", budget.lora_bytes),
        ("Activation peak", budget.activation_bytes),
        ("Encoder cache", budget.encoder_cache_bytes),
        ("CUDA graphs", budget.cuda_graph_bytes),
        ("KV cache", kv_bytes),
    ]
    if budget.extensible:
        kept = budget.budget_bytes - kv_bytes - sum(budget.outside_kv_bytes.values())
        rows.append(("Margin kept free", max(kept, 0)))
    total = budget.gpu_memory_bytes
    lines = [
        f"GPU memory per GPU: {format_bytes(total)} x gpu_memory_utilization {budget.gpu_memory_utilization:g} = "
        f"{format_bytes(budget.budget_bytes)}"
        + (" (extensible KV cache: sized after warm-up)" if budget.extensible else ""),
        "+" + "-" * width + "+",
    ]
    graphs_outside = 0 if budget.graphs_in_budget else budget.cuda_graph_bytes
    for name, size in rows:
        if size and not (name == "CUDA graphs" and graphs_outside):
            lines.append(f"| {name:<19}{format_bytes(size):>14}{size / total * 100:>9.1f} % |")
    lines.append("+" + "-" * width + "+")
    outside = total - budget.budget_bytes
    lines.append(f"| {'Outside the budget':<19}{format_bytes(outside):>14}{outside / total * 100:>9.1f} % |")
    if graphs_outside:  # captured after the cache, from the memory outside the budget
        lines.append(
            f"| {'  of it CUDA graphs':<19}{format_bytes(graphs_outside):>14}{graphs_outside / total * 100:>9.1f} % |"
        )
    lines.append("+" + "-" * width + "+")
    return lines


def what_if(plan: KvPlan, geometry: Geometry, inputs: PlanInputs, budget: MemoryBudget | None) -> list[str]:
    lines = []
    half = plan.max_model_len // 2
    if half >= plan.block_size:
        smaller = sizing.plan(geometry, replace(inputs, max_model_len=half))
        lines.append(
            f"  max_model_len {half:,} instead of {plan.max_model_len:,}: max concurrency "
            f"{smaller.max_concurrency:.2f}x (vLLM's capacity figure: {smaller.kv_cache_tokens:,} tokens)"
        )
    if budget is not None and budget.extensible and budget.gpu_memory_utilization < 1.0:
        unset = replace(budget, gpu_memory_utilization=1.0)
        bigger = sizing.plan(geometry, replace(inputs, kv_cache_memory_bytes=unset.kv_cache_bytes))
        gained = format_bytes(unset.kv_cache_bytes - budget.kv_cache_bytes)
        lines.append(
            f"  gpu_memory_utilization unset (1.0 under the extensible KV cache): +{gained} of KV cache, "
            f"{bigger.kv_cache_tokens:,} tokens, {bigger.max_concurrency:.2f}x"
        )
    elif budget is not None and budget.gpu_memory_utilization < 0.95:
        more = replace(budget, gpu_memory_utilization=min(0.95, budget.gpu_memory_utilization + 0.05))
        bigger = sizing.plan(geometry, replace(inputs, kv_cache_memory_bytes=more.kv_cache_bytes))
        gained = format_bytes(more.kv_cache_bytes - budget.kv_cache_bytes)
        lines.append(
            f"  gpu_memory_utilization {more.gpu_memory_utilization:g}: +{gained} of KV cache, "
            f"{bigger.kv_cache_tokens:,} tokens, {bigger.max_concurrency:.2f}x"
        )
    return lines


def _token_shape(plan: KvPlan, geometry: Geometry, kv_heads: int, dtype_bytes: int) -> str:
    """What a token's bytes are made of: the compressed latents' block, the MLA latent (and indexer), or K and V."""
    if geometry.compressed is not None:
        return f"a {format_bytes(plan.page_bytes)} block per {plan.block_size} tokens of the compressed latents"
    if "mla" in geometry.layer_kinds:
        if geometry.indexer_bytes:
            return (
                f"{plan.kv_layers_per_rank} layers x (latent {geometry.head_dim} x {dtype_bytes} B + indexer "
                f"{geometry.indexer_bytes} B)"
            )
        latent_layers = geometry.layer_kinds.count("mla") if plan.groups else plan.kv_layers_per_rank
        return f"{latent_layers} layers x latent {geometry.head_dim} x {dtype_bytes} B"
    growing = sum(g.layers for g in plan.groups if g.kind == "full") if plan.groups else plan.kv_layers_per_rank
    draft = plan.draft_pages
    shape = (
        f"K and V x {growing - (draft.layers if draft else 0)} layers x {kv_heads} KV heads x {geometry.head_dim} "
        f"x {dtype_bytes} B"
    )
    return shape + (f" + the drafter's {format_bytes(draft.bytes_per_token)} in {draft.layers} layers" if draft else "")


def _layout_lines(plan: KvPlan, geometry: Geometry, kv_heads: int, dtype_bytes: int) -> list[str]:
    """How the KV cache is cut up: one group of every layer, or vLLM's hybrid groups."""
    shape = _token_shape(plan, geometry, kv_heads, dtype_bytes)
    if not plan.groups:
        return [
            f"  bytes per token    {format_bytes(plan.kv_bytes_per_token):>14}   ({shape})",
            f"  blocks             {plan.num_gpu_blocks:>14,}   of {plan.block_size} tokens",
        ]
    kinds: dict[str, list[int]] = {}
    for g in plan.groups:
        kinds.setdefault(g.kind, []).append(g.blocks_per_request)
    per_request = ", ".join(
        f"{k} {len(v)} x {v[0]:,}" if len(set(v)) == 1 else f"{k} {'+'.join(f'{b:,}' for b in v)}"
        for k, v in kinds.items()
    )
    block = format_bytes(plan.page_bytes * plan.group_size)
    if geometry.compressed is not None:  # DeepSeek-V4: groups of other block sizes packed into one pool
        grows, cut, row = "the part that grows with the context", "packed (", f"blocks of {block}, the widest group's"
        blocks = f"shared by every group ({plan.block_size} tokens of the compressed latents a block)"
    else:
        grows, cut, row = "the full-attention layers, which grow with the context", f"of {plan.group_size} layers (", ""
        blocks = f"of {plan.block_size} tokens, shared by every group"
    return [
        f"  bytes per token    {format_bytes(plan.kv_bytes_per_token):>14}   ({shape}: {grows})",
        f"  groups             {len(plan.groups):>14}   {cut}"
        + ", ".join(f"{len(v)} {k}" for k, v in kinds.items())
        + f"), {row or f'one {block} block per group row'}",
        f"  blocks             {plan.num_gpu_blocks:>14,}   {blocks}",
        f"  per request        {sum(g.blocks_per_request for g in plan.groups):>14,}   blocks at max_model_len "
        f"({per_request})",
    ]


def render_text(plan: KvPlan, geometry: Geometry, inputs: PlanInputs, budget: MemoryBudget | None) -> str:
    if "mla" in geometry.layer_kinds and inputs.version < MLA_LATENT_CACHE:
        geometry = sizing.as_multi_head(geometry)[0]  # the shape vLLM cached it in, as the plan's note says
    kv_heads = 1 if "mla" in geometry.layer_kinds else max(1, geometry.num_kv_heads // inputs.tp)
    lines = [
        f"Plan for {geometry.architecture}: TP {inputs.tp}, PP {inputs.pp}, KV dtype {inputs.kv_cache_dtype}"
        f" (model {geometry.dtype}), block size {plan.block_size}, rules: {plan.rules}",
        "",
    ]
    if budget is not None:
        lines += [*budget_picture(budget, plan.kv_cache_memory_bytes), ""]
    dtype_bytes = kv_dtype_bytes(inputs.kv_cache_dtype, geometry.dtype)
    if geometry.compressed is None:
        geometry = sizing.packed_rows(geometry, inputs.kv_cache_dtype)  # fp8_ds_mla: a latent as wide as its bytes
    lines += [
        "KV cache per GPU",
        f"  memory             {format_bytes(plan.kv_cache_memory_bytes):>14}",
        *_layout_lines(plan, geometry, kv_heads, dtype_bytes),
        f"  capacity           {plan.kv_cache_tokens:>14,} tokens",
        f"  max concurrency    {plan.max_concurrency:>13.2f}x   at max_model_len {plan.max_model_len:,}",
        *(
            [f"  CPU tier           {plan.cpu_tier_tokens:>14,} tokens   (--kv-offloading-size, for prefix reuse)"]
            if plan.cpu_tier_tokens is not None
            else []
        ),
        "",
        "Concurrency at other context lengths",
    ]
    for ctx in (*CONTEXTS, 32768):
        if ctx < plan.max_model_len:
            each = format_bytes(plan.request_bytes(ctx))
            lines.append(f"  {ctx:>8,} tokens   {plan.concurrency_at(ctx):>9.2f}x   {each:>12} each")
    lines += ["", "What would change it", *what_if(plan, geometry, inputs, budget)]
    notes = [*plan.notes, *memory_notes(geometry, inputs, budget)]
    if notes:
        lines += ["", "How vLLM sizes this model", *(f"  - {note}" for note in notes)]
    return "\n".join(lines) + "\n"
