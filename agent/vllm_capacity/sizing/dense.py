"""Models of one KV layer kind (full attention, or MLA): vLLM's single KV-cache group, in V0 and in V1."""

from __future__ import annotations

import math
from dataclasses import replace

from vllm_capacity.geometry import Geometry
from vllm_capacity.sizing.errors import ImpossiblePlan, NotModelled
from vllm_capacity.sizing.inputs import PlanInputs
from vllm_capacity.sizing.layers import STATE_KINDS, bytes_per_token_per_layer, kv_dtype_bytes, layers_per_rank
from vllm_capacity.sizing.result import KvPlan
from vllm_capacity.sizing.speculative import DraftPages
from vllm_capacity.sizing.versions import TOKENS_FROM_CONCURRENCY, WHOLE_BLOCKS_PER_REQUEST
from vllm_capacity.units import GiB


def max_concurrency(
    blocks: int, block_size: int, max_model_len: int, *, engine: str, version: tuple[int, int, int]
) -> float:
    """vLLM's "Maximum concurrency for N tokens per request" of a full-attention cache of ``blocks`` blocks, as
    ``engine`` (v0 or v1) of ``version`` computes it: V0 and V1 before 0.9.1 ``blocks x block_size / max_model_len``
    (V0's executor_base.py); V1 from 0.9.1 ``blocks / ceil(max_model_len / block_size)``: a request needs whole blocks
    (``get_max_concurrency_for_kv_cache_config`` in vllm/v1/core/kv_cache_utils.py). The live agent and the planner
    both use this one function."""
    if engine == "v0" or version < WHOLE_BLOCKS_PER_REQUEST:
        return blocks * block_size / max_model_len
    return blocks / math.ceil(max_model_len / block_size)


def plan_dense(geometry: Geometry, inputs: PlanInputs, draft: DraftPages | None = None) -> KvPlan:
    """vLLM's blocks, "KV cache size" and "Maximum concurrency" for a model whose KV layers are all of one kind;
    ``draft``: a speculative drafter's layers whose pages differ from the model's, in the same group (a block then
    costs every layer's page)."""
    engine, version, block_size, max_model_len = (
        inputs.resolved_engine,
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
    if engine == "v0":
        blocks = int(kv_cache_memory_bytes // (page * layers))
    elif draft:
        blocks = int(kv_cache_memory_bytes // (bytes_per_token * block_size))  # UniformTypeKVCacheSpecs' page sum
    else:
        blocks = int(kv_cache_memory_bytes // page // layers)
    blocks_per_request = math.ceil(max_model_len / block_size)
    concurrency = max_concurrency(blocks, block_size, max_model_len, engine=engine, version=version)
    if engine == "v0" or version < WHOLE_BLOCKS_PER_REQUEST:
        rules = f"{engine} <= 0.9.0: blocks x block_size / max_model_len"
    else:
        rules = "v1 >= 0.9.1: blocks / ceil(max_model_len / block_size)"
    from_concurrency = engine == "v1" and version >= TOKENS_FROM_CONCURRENCY
    tokens = int(concurrency * max_model_len) if from_concurrency else blocks * block_size
    if blocks < blocks_per_request:
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


def as_single_group(geometry: Geometry, engine: str) -> tuple[Geometry, str]:
    """Before V1 0.9.1 there are no KV-cache groups: vLLM sizes every attention layer like full attention."""
    kinds = set(geometry.layer_kinds)
    if kinds & set(STATE_KINDS) and engine == "v1":
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
    note = f"{engine} before 0.9.1 sizes {which} layers like full attention"
    if "mamba" in kinds:
        note += "; V0 keeps the Mamba state outside the KV-cache budget, so only attention layers count"
    return replace(geometry, layer_kinds=flat), note
