"""vLLM's KV-cache sizing rules, per version: from geometry and memory to blocks, tokens and max concurrency.

Pure functions over plain data, after vLLM's ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/v1/kv_cache_interface.py``
(V1) and ``vllm/worker/cache_engine.py`` (V0); the rules per version are explained in ``docs/planning.md``:

* bytes per token per GPU rank, per KV layer: ``2 x max(1, kv_heads // tp) x head_dim x kv_dtype_bytes``
  (MLA: ``1 x latent x kv_dtype_bytes``; before 0.7.1 ``2 x heads // tp x 256``); pipeline parallelism splits the
  layers over stages.
* blocks: V0 ``int(kv_memory // (block_size x bytes_per_token))``; V1 ``int(kv_memory // page // layers)``.
* "KV cache size" tokens: ``blocks x block_size`` (V1 0.8 - 0.19); ``int(max_concurrency x max_model_len)`` (>= 0.20).
* "Maximum concurrency": V0 and V1 <= 0.9.0 ``blocks x block_size / max_model_len``; V1 >= 0.9.1
  ``blocks / ceil(max_model_len / block_size)``.

Hybrid models (V1 >= 0.9.1): vLLM's KV-cache groups with a uniform page size. Layers are bucketed by kind
(full, sliding window, Mamba-2), each bucket split into groups of ``group_size`` layers (the smallest bucket, or the
largest when they are close; the last group of a bucket padded), and one pool of ``memory // (page x group_size)``
blocks serves every group. A request of ``max_model_len`` holds ``ceil(max_model_len / block_size)`` blocks per full
group, ``ceil(min(window - 1 + in-flight tokens, max_model_len) / block_size) + 1`` per sliding group and 1 (or 3 in
'align' mode) per Mamba group. For Mamba the attention block size is raised until a page holds one Mamba state, and
the Mamba page is padded to it (Gated DeltaNet layers likewise, with 2 blocks in 'align' mode). Before 0.9.1 (and in
V0) sliding layers are sized like full ones and V0 keeps the Mamba state outside the KV budget. Shared-KV layers hold
nothing of their own. Llama 4's chunked local attention layers hold ``ceil(min(chunk + in-flight tokens,
max_model_len) / block_size)`` blocks per request in groups of their own (from 0.10.0, when vLLM's hybrid manager
takes them; else they are sized like full attention). Attention-free models, MLA mixed with other
kinds and hybrid layouts under PP raise :class:`NotModelled`. Mamba-1 (Jamba) state is sized like Mamba-2's
(its shape: ``(d_conv - 1) x inner + inner x d_state`` per rank), from 0.10.2.

The package, by concern: :mod:`.versions` (where vLLM changed its rules), :mod:`.inputs` (what a plan is asked for),
:mod:`.layers` (bytes per token, and each layer kind's spec), :mod:`.dense` (one kind of KV layer),
:mod:`.hybrid` (vLLM's KV-cache groups), :mod:`.compressed` (DeepSeek-V4's packed groups),
:mod:`.speculative` (a drafter's layers in the same pool),
:mod:`.result` (a plan), :mod:`.memory` (the GPU's memory budget), :mod:`.lora` (LoRA adapter slots in it).
"""

from __future__ import annotations

from dataclasses import replace

from vllm_capacity.geometry import Geometry
from vllm_capacity.sizing.compressed import plan_compressed
from vllm_capacity.sizing.dense import as_single_group, max_concurrency, plan_dense, started_below_one
from vllm_capacity.sizing.errors import ImpossiblePlan, NotModelled
from vllm_capacity.sizing.hybrid import chunked_local_groups, plan_hybrid
from vllm_capacity.sizing.inputs import PlanInputs, default_max_num_batched_tokens, default_max_num_seqs
from vllm_capacity.sizing.layers import (
    PER_TOKEN_HEAD,
    ROW_SCALE_BYTES,
    bytes_per_token_per_layer,
    kv_dtype_bytes,
    layers_per_rank,
    packed_rows,
    sparse_latent_assumption,
)
from vllm_capacity.sizing.memory import MemoryBudget, sampler_peak_bytes
from vllm_capacity.sizing.offload import cpu_tier_tokens, latent_shared_by_ranks
from vllm_capacity.sizing.result import KvGroup, KvPlan
from vllm_capacity.sizing.speculative import DraftPages, Speculation, with_drafter
from vllm_capacity.sizing.state import attention_only_hybrid_block
from vllm_capacity.sizing.versions import (
    HYBRID_GROUPS,
    MLA_LATENT_CACHE,
    MLA_MHA_HEAD_SIZE,
    NEWEST_RULES,
    NEWEST_VERSION,
    PER_TOKEN_HEAD_SCALES,
    SPARSE_INDEXER,
    UNIFIED_PAGE_SIZES,
    EngineVersion,
    SizingRules,
    Version,
    dotted,
    parse_version,
)
from vllm_capacity.units import GiB

__all__ = [
    "NEWEST_RULES",
    "NEWEST_VERSION",
    "EngineVersion",
    "ImpossiblePlan",
    "KvGroup",
    "KvPlan",
    "MemoryBudget",
    "NotModelled",
    "PlanInputs",
    "SizingRules",
    "Speculation",
    "Version",
    "bytes_per_token_per_layer",
    "cpu_tier_tokens",
    "default_max_num_batched_tokens",
    "default_max_num_seqs",
    "kv_dtype_bytes",
    "latent_shared_by_ranks",
    "layers_per_rank",
    "max_concurrency",
    "packed_rows",
    "parse_version",
    "plan",
    "sampler_peak_bytes",
    "sparse_latent_assumption",
]


def plan(geometry: Geometry, inputs: PlanInputs) -> KvPlan:
    """Size the KV cache as vLLM ``inputs.version`` does for a per-rank budget of ``inputs.kv_cache_memory_bytes``."""
    inputs.check()
    engine_version = inputs.resolved_engine_version
    if inputs.kv_cache_memory_bytes <= 0:
        raise ImpossiblePlan(f"no memory is left for the KV cache ({inputs.kv_cache_memory_bytes / GiB:.2f} GiB)")
    if geometry.unmodelled_cache:
        raise NotModelled(f"{geometry.architecture}: {geometry.unmodelled_cache}")
    if geometry.compressed is not None:
        return plan_compressed(geometry, inputs)
    if geometry.full_shape is not None:
        geometry = _with_full_shape(geometry, inputs)
    if not set(geometry.layer_kinds) & {"full", "sliding", "chunked", "mla"}:
        raise NotModelled(f"{geometry.architecture} has no attention layer: vLLM allocates it no KV cache blocks")
    draft: DraftPages | None = None
    notes: list[str] = []
    rows = packed_rows(geometry, inputs.kv_cache_dtype)  # a format the model's layers cannot take: refused by name
    if geometry.indexer_bytes is not None:
        notes = _sparse_attention(geometry, inputs)
    if inputs.kv_cache_dtype.lower() in PER_TOKEN_HEAD:
        notes = _per_token_head(geometry, rows, inputs)
    if rows is not geometry and inputs.speculation and inputs.speculation.draft:
        raise NotModelled(
            f"{geometry.architecture}: a drafter of its own (--draft-model-config) beside --kv-cache-dtype "
            f"{inputs.kv_cache_dtype}: the format its layers take is not modelled"
        )
    geometry = rows
    if inputs.speculation is not None:
        geometry, draft, drafted = with_drafter(
            geometry,
            inputs.speculation,
            tp=inputs.tp,
            pp=inputs.pp,
            kv_dtype_bytes=kv_dtype_bytes(inputs.kv_cache_dtype, geometry.dtype),
            engine_version=engine_version,
            version=inputs.version,
        )
        notes += drafted
    as_read, read_as = _as_the_release_reads(geometry, inputs, engine_version)
    block_size, raised = attention_only_hybrid_block(as_read, inputs)
    if raised:
        inputs = replace(inputs, block_size=block_size)
        read_as.append(raised)
    try:
        result = _sized(as_read, inputs, engine_version, draft)
    except ImpossiblePlan as refused:  # raised again unless the release checked before it sized (and started)
        result = started_below_one(geometry, as_read, inputs, draft, refused)
    geometry = as_read
    result.notes[:0] = notes + read_as
    if inputs.kv_offloading_bytes:
        result = _with_cpu_tier(result, geometry, inputs)
    return result


def _as_the_release_reads(
    geometry: Geometry, inputs: PlanInputs, engine_version: EngineVersion
) -> tuple[Geometry, list[str]]:
    """The layers as the release sizes them, and what that notes: chunked layers as full attention where its hybrid
    manager is off, an MLA latent as multi-head attention before the latent cache."""
    notes = []
    if "chunked" in geometry.layer_kinds and engine_version == "v1" and inputs.version >= HYBRID_GROUPS:
        hybrid, why = chunked_local_groups(inputs)
        if not hybrid:
            kinds = tuple("full" if k == "chunked" else k for k in geometry.layer_kinds)
            geometry = replace(geometry, layer_kinds=kinds)
        notes.append(why)
    if "mla" in geometry.layer_kinds and inputs.version < MLA_LATENT_CACHE:
        geometry, note = as_multi_head(geometry)
        notes.append(note)
    return geometry, notes


def _sized(geometry: Geometry, inputs: PlanInputs, engine_version: EngineVersion, draft: DraftPages | None) -> KvPlan:
    """One KV-cache group for a model of one layer kind; the hybrid groups where the release makes them; else the
    single group older releases force every kind into (said in the plan's notes)."""
    if geometry.uniform:
        return plan_dense(geometry, inputs, draft)
    if engine_version == "v1" and inputs.version >= HYBRID_GROUPS:
        return plan_hybrid(geometry, inputs)
    flat, note = as_single_group(geometry, engine_version)
    result = plan_dense(flat, replace(inputs, engine_version=engine_version))
    result.notes.insert(0, note)  # before what sizing the single group notes, after what led to it
    return result


def _sparse_attention(geometry: Geometry, inputs: PlanInputs) -> list[str]:
    """What a plan of a DeepSeek sparse-attention model notes: each layer's indexer keys beside the latent, in the
    same group, and the latent's format where the dtype alone does not settle it (assumed, and said)."""
    if inputs.resolved_engine_version != "v1" or inputs.version < SPARSE_INDEXER:
        raise NotModelled(
            f"{geometry.architecture}: DeepSeek sparse attention's indexer cache is planned as vLLM "
            f"{dotted(SPARSE_INDEXER)} (V1) lays it out; earlier releases were not read"
        )
    assert geometry.indexer_bytes is not None
    notes = [
        f"DeepSeek sparse attention: each MLA layer keeps its indexer's keys beside the latent, "
        f"{geometry.indexer_bytes} B per token (fp8 values and a float32 scale per 128), in the same KV-cache group"
    ]
    assumed = sparse_latent_assumption(geometry, inputs.kv_cache_dtype)
    return [*notes, assumed] if assumed else notes


def _per_token_head(geometry: Geometry, rows: Geometry, inputs: PlanInputs) -> list[str]:
    """What a plan under per-token-head quantisation notes (each head's K and V rows with a float32 scale: ``rows``,
    :func:`packed_rows`'), where it was read: vLLM 0.32, the full-attention layers of a model without other kinds."""
    name = inputs.kv_cache_dtype.lower()
    if inputs.resolved_engine_version != "v1" or inputs.version < PER_TOKEN_HEAD_SCALES:
        raise NotModelled(
            f"--kv-cache-dtype {name} is planned as vLLM {dotted(PER_TOKEN_HEAD_SCALES)} (V1) stores it; earlier "
            "releases were not read"
        )
    if not geometry.uniform:
        kinds = ", ".join(sorted({k for k in geometry.layer_kinds if k not in ("none", "shared")}))
        raise NotModelled(
            f"{geometry.architecture}: --kv-cache-dtype {name} beside {kinds} layers: the block sizes the Triton "
            "backend (the one that takes it) gives them are not modelled"
        )
    values = rows.head_dim - ROW_SCALE_BYTES
    return [
        f"{name}: each head's K and V rows of {geometry.head_dim} values take {values} B and a "
        f"float32 scale, {rows.head_dim} B (vLLM's Triton attention, the one backend that takes it)"
    ]


def _with_full_shape(geometry: Geometry, inputs: PlanInputs) -> Geometry:
    """A model whose full-attention layers have a shape of their own (Gemma 4): planned where vLLM's page
    unification was read, as one shape when every KV layer is a full one."""
    if inputs.version < UNIFIED_PAGE_SIZES or inputs.resolved_engine_version != "v1":
        raise NotModelled(
            f"{geometry.architecture}: full-attention layers of another shape than the others are planned from vLLM "
            f"{dotted(UNIFIED_PAGE_SIZES)} (V1), whose unify_kv_cache_spec_page_size was read"
        )
    if {k for k in geometry.layer_kinds if k not in ("none", "shared")} == {"full"}:
        assert geometry.full_shape is not None
        heads, head_dim = geometry.full_shape
        return replace(geometry, num_kv_heads=heads, head_dim=head_dim, full_shape=None)
    return geometry


def _with_cpu_tier(result: KvPlan, geometry: Geometry, inputs: PlanInputs) -> KvPlan:
    """The plan with the CPU tier of ``--kv-offloading-size`` (V1's native offloading)."""
    if inputs.resolved_engine_version != "v1":
        raise NotModelled("KV offloading (--kv-offloading-size) is a V1 feature; V0's CPU tier is its swap space")
    assert inputs.kv_offloading_bytes is not None
    ranks = inputs.tp * inputs.pp
    shared = latent_shared_by_ranks(mla="mla" in geometry.layer_kinds, tp=inputs.tp, pp=inputs.pp)
    tokens = cpu_tier_tokens(
        offloading_bytes=inputs.kv_offloading_bytes,
        worker_bytes_per_block=result.worker_bytes_per_block,
        world_size=ranks,
        block_size=result.block_size,
        version=inputs.version,
        copies=1 if shared else ranks,
    )
    copies = (
        "one copy of the latent, which every TP rank holds alike (assumed: one node and vLLM's default "
        f"multiprocessing executor; with Ray or across nodes each rank keeps its own, {ranks}x fewer tokens)"
        if shared
        else f"{ranks} rank(s)"
    )
    note = (
        f"CPU tier: {inputs.kv_offloading_bytes / GiB:g} GiB over {copies} in chunks of one block "
        f"({result.worker_bytes_per_block:,} bytes per rank, page-aligned): {tokens:,} tokens more, which vLLM "
        "reloads to the GPU to reuse a prefix; they do not add concurrency"
    )
    return replace(result, cpu_tier_tokens=tokens, notes=[*result.notes, note])


def as_multi_head(geometry: Geometry) -> tuple[Geometry, str]:
    """An MLA model as vLLM before 0.7.1 cached it: full multi-head attention, K and V of every head padded to 256."""
    if geometry.mla_heads is None:
        raise NotModelled(
            f"{geometry.architecture}: vLLM before 0.7.1 cached MLA models per attention head, and config.json "
            "gives no num_attention_heads"
        )
    kinds = tuple("full" if k == "mla" else k for k in geometry.layer_kinds)
    note = (
        f"vLLM before 0.7.1 cached this MLA model as multi-head attention: K and V of {geometry.mla_heads} heads "
        f"x {MLA_MHA_HEAD_SIZE} (padded) per layer, not one latent of {geometry.head_dim}"
    )
    return replace(geometry, layer_kinds=kinds, num_kv_heads=geometry.mla_heads, head_dim=MLA_MHA_HEAD_SIZE), note
