"""Models of one KV layer kind (full attention, or MLA): vLLM's single KV-cache group, in V0 and in V1."""

from __future__ import annotations

import math
from dataclasses import replace

from vllm_capacity.geometry import Geometry
from vllm_capacity.sizing.errors import ImpossiblePlan, NotModelled
from vllm_capacity.sizing.inputs import PlanInputs
from vllm_capacity.sizing.layers import (
    STATE_KINDS,
    ChunkedLocalSpec,
    bytes_per_token_per_layer,
    kv_dtype_bytes,
    layers_per_rank,
)
from vllm_capacity.sizing.result import KvPlan
from vllm_capacity.sizing.speculative import DraftPages
from vllm_capacity.sizing.versions import (
    CHECK_AFTER_UNIFYING,
    CHUNKED_LOCAL_GROUPS,
    TOKENS_FROM_CONCURRENCY,
    WHOLE_BLOCKS_PER_REQUEST,
    EngineVersion,
    Version,
    dotted,
)
from vllm_capacity.units import GiB


def max_concurrency(
    blocks: int, block_size: int, max_model_len: int, *, engine_version: EngineVersion, version: Version
) -> float:
    """vLLM's "Maximum concurrency for N tokens per request" of a full-attention cache of ``blocks`` blocks, as
    ``engine_version`` (v0 or v1) of ``version`` computes it: V0 and V1 before 0.9.1 ``blocks x block_size /
    max_model_len`` (V0's executor_base.py); V1 from 0.9.1 ``blocks / ceil(max_model_len / block_size)``: a request
    needs whole blocks (``get_max_concurrency_for_kv_cache_config`` in vllm/v1/core/kv_cache_utils.py). The live
    agent and the planner both use this one function."""
    if engine_version == "v0" or version < WHOLE_BLOCKS_PER_REQUEST:
        return blocks * block_size / max_model_len
    return blocks / math.ceil(max_model_len / block_size)


def plan_dense(
    geometry: Geometry, inputs: PlanInputs, draft: DraftPages | None = None, *, refuse_below_one: bool = True
) -> KvPlan:
    """vLLM's blocks, "KV cache size" and "Maximum concurrency" for a model whose KV layers are all of one kind;
    ``draft``: a speculative drafter's layers whose pages differ from the model's, in the same group (a block then
    costs every layer's page). ``refuse_below_one`` False: a cache that cannot hold one request of max_model_len is
    planned (where the release checked something else and started)."""
    engine_version, version, block_size, max_model_len = (
        inputs.resolved_engine_version,
        inputs.version,
        inputs.block_size,
        inputs.max_model_len,
    )
    kv_cache_memory_bytes = inputs.kv_cache_memory_bytes
    dtype_bytes = kv_dtype_bytes(inputs.kv_cache_dtype, geometry.dtype)
    per_layer = bytes_per_token_per_layer(geometry, inputs.tp, dtype_bytes)
    layers = layers_per_rank(geometry.kv_layers, inputs.pp)
    page = per_layer * block_size
    bytes_per_token = per_layer * layers + (draft.bytes_per_token if draft else 0)
    if engine_version == "v0":
        blocks = int(kv_cache_memory_bytes // (page * layers))
    elif draft:
        blocks = int(kv_cache_memory_bytes // (bytes_per_token * block_size))  # UniformTypeKVCacheSpecs' page sum
    else:
        blocks = int(kv_cache_memory_bytes // page // layers)
    blocks_per_request = math.ceil(max_model_len / block_size)
    concurrency = max_concurrency(blocks, block_size, max_model_len, engine_version=engine_version, version=version)
    if engine_version == "v0" or version < WHOLE_BLOCKS_PER_REQUEST:
        rules = f"{engine_version} <= 0.9.0: blocks x block_size / max_model_len"
    else:
        rules = "v1 >= 0.9.1: blocks / ceil(max_model_len / block_size)"
    from_concurrency = engine_version == "v1" and version >= TOKENS_FROM_CONCURRENCY
    tokens = int(concurrency * max_model_len) if from_concurrency else blocks * block_size
    if blocks < blocks_per_request and refuse_below_one:
        needed = blocks_per_request * block_size * bytes_per_token
        raise ImpossiblePlan(
            f"one request of max_model_len {max_model_len:,} tokens needs {needed / GiB:.2f} GiB of KV cache per "
            f"GPU, more than the {kv_cache_memory_bytes / GiB:.2f} GiB available; vLLM would refuse to start. "
            f"Estimated maximum model length: {blocks * block_size:,}"
        )
    return KvPlan(
        kv_bytes_per_token=bytes_per_token,
        kv_layers_per_rank=layers + (draft.layers if draft else 0),
        block_size=block_size,
        num_gpu_blocks=blocks,
        kv_cache_tokens=tokens,
        max_concurrency=concurrency,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        rules=rules,
        page_bytes=page,
        lookahead_tokens=inputs.lookahead_tokens,
        draft_pages=draft,
    )


def as_single_group(geometry: Geometry, engine_version: EngineVersion) -> tuple[Geometry, str]:
    """Before V1 0.9.1 there are no KV-cache groups: vLLM sizes every attention layer like full attention."""
    kinds = set(geometry.layer_kinds)
    if kinds & set(STATE_KINDS) and engine_version == "v1":
        raise NotModelled(
            f"{geometry.architecture} has Mamba / linear-attention layers: vLLM V1 before 0.9.1 did not serve such "
            "hybrid models (V0 did: pass --engine v0)"
        )
    if "linear" in kinds:
        raise NotModelled(f"{geometry.architecture}: V0 never served linear-attention (Gated DeltaNet) layers")
    if "mla" in kinds:
        raise NotModelled(f"{geometry.architecture} mixes MLA with other layer kinds {sorted(kinds)}")
    flat = tuple(
        "full" if k in ("sliding", "chunked") else "none" if k in ("mamba", "shared") else k
        for k in geometry.layer_kinds
    )
    which = "sliding-window and chunked" if "chunked" in kinds else "sliding-window"
    note = f"{engine_version} before 0.9.1 sizes {which} layers like full attention"
    if "mamba" in kinds:
        note += "; V0 keeps the Mamba state outside the KV-cache budget, so only attention layers count"
    return replace(geometry, layer_kinds=flat), note


def started_below_one(
    geometry: Geometry, as_read: Geometry, inputs: PlanInputs, draft: DraftPages | None, refused: ImpossiblePlan
) -> KvPlan:
    """A cache too small for one request of max_model_len, where the release started anyway: with the hybrid manager
    off, vLLM 0.10.0 to 0.13 checked one request against each layer's own spec (a chunked local attention layer needs
    chunk + max_num_batched_tokens, not max_model_len) and only then sized the chunked layers as full attention
    (CHECK_AFTER_UNIFYING). Planned below 1x with a note there; raises ``refused`` (the sizing's own refusal)
    anywhere else, and ImpossiblePlan in vLLM's terms where that release refused too."""
    chunked = geometry.layer_kinds.count("chunked")
    unified_later = chunked and "chunked" not in as_read.layer_kinds and inputs.resolved_engine_version == "v1"
    if not unified_later or not as_read.uniform or not CHUNKED_LOCAL_GROUPS <= inputs.version < CHECK_AFTER_UNIFYING:
        raise refused
    plan = plan_dense(as_read, inputs, draft, refuse_below_one=False)
    bs, mml = inputs.block_size, inputs.max_model_len
    # the chunked layer's spec as those releases counted it: chunk + one batch (no async-scheduling term yet)
    spec = ChunkedLocalSpec(bs, mml, geometry.attention_chunk_size or 0, inputs.max_num_batched_tokens)
    chunk = min(spec.chunk + spec.in_flight_tokens, mml)
    full = len(geometry.layer_kinds) - chunked
    needed = (
        layers_per_rank(full, inputs.pp) * math.ceil(mml / bs)
        + layers_per_rank(chunked, inputs.pp) * spec.blocks_per_request
    ) * plan.page_bytes
    if needed > inputs.kv_cache_memory_bytes:
        raise ImpossiblePlan(
            f"one request of max_model_len {mml:,} tokens needs {needed / GiB:.2f} GiB of KV cache per GPU as vLLM "
            f"{dotted(inputs.version)} counts it (a chunked local attention layer at chunk + max_num_batched_tokens), "
            f"more than the {inputs.kv_cache_memory_bytes / GiB:.2f} GiB available; vLLM would refuse to start"
        )
    plan.notes.append(
        f"vLLM {dotted(CHUNKED_LOCAL_GROUPS)} to 0.13 checks one request of max_model_len against each chunked layer's "
        f"own need ({chunk:,} tokens) before it sizes those layers as full attention, so it starts with a cache of "
        f"{plan.kv_cache_tokens:,} tokens, {plan.max_concurrency:.2f}x of one max_model_len request: a request longer "
        f"than that cannot be held whole. From {dotted(CHECK_AFTER_UNIFYING)} vLLM refuses to start here"
    )
    return plan
