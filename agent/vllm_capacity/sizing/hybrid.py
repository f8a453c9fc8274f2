"""Hybrid models in vLLM V1 >= 0.9.1: KV-cache groups of a uniform page size (``_get_kv_cache_groups_uniform_page_size``
in vllm/v1/core/kv_cache_utils.py).

Layers are bucketed by kind, each bucket is cut into groups of ``group_size`` layers (the last one padded), and one
pool of ``memory // (page x group_size)`` blocks serves every group; a request holds the sum of its blocks in each
group. For state layers (Mamba-2, Gated DeltaNet) the attention block grows until a page holds one state, and the
state page is padded to it. :func:`plan_hybrid` runs these steps in order, one function each.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

from vllm_capacity.geometry import Geometry, KimiDeltaGeometry
from vllm_capacity.sizing.errors import ImpossiblePlan, NotModelled
from vllm_capacity.sizing.inputs import PlanInputs
from vllm_capacity.sizing.layers import (
    STATE_KINDS,
    ChunkedLocalSpec,
    FullAttentionSpec,
    LayerSpec,
    SlidingWindowSpec,
    StateSpec,
    bytes_per_token_per_layer,
    kv_dtype_bytes,
)
from vllm_capacity.sizing.result import KvGroup, KvPlan
from vllm_capacity.sizing.speculative import adds_layers
from vllm_capacity.sizing.state import state_layout, where
from vllm_capacity.sizing.versions import (
    CHUNKED_LOCAL_DEFAULT_ON,
    CHUNKED_LOCAL_GROUPS,
    GROUP_RATIOS,
    IN_FLIGHT_TOKENS,
    KIMI_LINEAR,
    PADDED_PAGES,
    SLIDING_MTP_RETAINED,
    TOKENS_FROM_CONCURRENCY,
    dotted,
)
from vllm_capacity.units import GiB, MiB


def plan_hybrid(geometry: Geometry, inputs: PlanInputs) -> KvPlan:
    """vLLM's blocks, tokens and maximum concurrency for a model with more than one kind of cache layer."""
    counts = _buckets(geometry, inputs)
    notes: list[str] = []
    dtype_bytes = kv_dtype_bytes(inputs.kv_cache_dtype, geometry.dtype)
    per_layer = bytes_per_token_per_layer(geometry, inputs.tp, dtype_bytes)
    full_per_layer = _full_bytes_per_token(geometry, counts, inputs, dtype_bytes) or per_layer
    block_size, state_blocks = state_layout(geometry, counts, inputs, per_layer, notes)
    group_size = _group_size(counts, inputs.version)
    in_flight = in_flight_tokens(inputs)
    block_sizes, page = _unified_pages(counts, block_size, per_layer, full_per_layer, notes, inputs.version)
    specs = _layer_specs(geometry, inputs, block_sizes, state_blocks, in_flight)
    groups = _groups(counts, group_size, specs, notes)
    batches = f"max_num_batched_tokens {inputs.max_num_batched_tokens:,}" + (
        " x 2 batches under async scheduling" if in_flight != inputs.max_num_batched_tokens else ""
    )
    if "sliding" in counts:
        notes.append(
            f"sliding-window layers hold at most window {geometry.sliding_window} - 1 + {in_flight:,} in-flight tokens "
            f"per request ({batches})"
        )
    if "chunked" in counts:
        notes.append(
            f"chunked local attention layers hold at most chunk {geometry.attention_chunk_size:,} + {in_flight:,} "
            f"in-flight tokens per request ({batches})"
        )
    return _pool(counts, PoolShape(groups, group_size, page, full_per_layer, block_size), inputs, notes)


def _full_bytes_per_token(geometry: Geometry, counts: Counter[str], inputs: PlanInputs, dtype_bytes: int) -> int | None:
    """Bytes per token of one full-attention layer where its shape is not the other layers' (Gemma 4's
    global_head_dim); None where they share one."""
    if geometry.full_shape is None:
        return None
    heads, head_dim = geometry.full_shape  # the release was checked by sizing.plan
    if set(counts) & set(STATE_KINDS) or (inputs.speculation and adds_layers(geometry, inputs.speculation)):
        raise NotModelled(
            f"{where(geometry, counts)}: full-attention layers of another shape beside state layers or a drafter "
            "are not modelled"
        )
    return 2 * max(1, heads // inputs.tp) * head_dim * dtype_bytes


def _unified_pages(
    counts: Counter[str],
    block_size: int,
    per_layer: int,
    full_per_layer: int,
    notes: list[str],
    version: tuple[int, int, int],
) -> tuple[dict[str, int], int]:
    """Each kind's block size and the one page size every layer then has (``unify_kv_cache_spec_page_size``): a kind
    whose page is a whole fraction of the largest takes that many times the block size; another is padded (from
    0.24.0; vLLM refused to start before)."""
    pages = {kind: block_size * (full_per_layer if kind == "full" else per_layer) for kind in counts}
    pages = {kind: page for kind, page in pages.items() if kind not in STATE_KINDS}  # a state page is padded to it
    largest = max(pages.values())
    sizes = dict.fromkeys(counts, block_size)
    for kind, page in pages.items():
        if page == largest:
            continue
        if largest % page:
            if version < PADDED_PAGES:
                raise ImpossiblePlan(
                    f"vLLM {dotted(version)} does not start this model: the {kind} layers' page ({page:,} bytes) "
                    f"does not divide the largest ({largest:,}), and unify_kv_cache_spec_page_size raises "
                    f"NotImplementedError before {dotted(PADDED_PAGES)}, which pads it"
                )
            notes.append(f"the {kind} layers' page is padded from {page:,} to {largest:,} bytes")
            continue
        sizes[kind] = block_size * (largest // page)
        notes.append(
            f"the {kind} layers' pages are {largest // page}x smaller than the largest: vLLM gives them "
            f"{sizes[kind]}-token blocks of the same {largest:,} bytes"
        )
    return sizes, largest


def _buckets(geometry: Geometry, inputs: PlanInputs) -> Counter[str]:
    """Layers by kind, leaving out those that hold no cache of their own; refuses what is not modelled."""
    counts = Counter(k for k in geometry.layer_kinds if k not in ("none", "shared"))
    if "mla" in counts and not (isinstance(geometry.state, KimiDeltaGeometry) and set(counts) <= {"mla", "linear"}):
        raise NotModelled(f"{where(geometry, counts)}: MLA mixed with other layer kinds is not modelled")
    if "mla" in counts and inputs.version < KIMI_LINEAR:
        raise NotModelled(
            f"{where(geometry, counts)}: MLA beside KDA state layers (Kimi Linear) is planned as vLLM "
            f"{dotted(KIMI_LINEAR)} lays it out; earlier releases were not read"
        )
    if inputs.pp > 1:
        raise NotModelled(
            f"{where(geometry, counts)}: how pipeline stages split a hybrid layer pattern is not modelled; use PP 1"
        )
    return counts


def _group_size(counts: Counter[str], version: tuple[int, int, int]) -> int:
    """Layers per group: the smallest bucket, or the largest when the buckets are close ("avoid too many padding
    layers", from 0.12)."""
    smallest, largest = min(counts.values()), max(counts.values())
    ratio = next((r for since, r in GROUP_RATIOS if version >= since), None)
    return largest if ratio is not None and largest < smallest * ratio else smallest


def in_flight_tokens(inputs: PlanInputs) -> int:
    """Tokens scheduled but not yet settled, which a sliding-window layer keeps beyond its window (0.32
    ``VllmConfig.max_in_flight_tokens``: one batch per concurrent step, two under async scheduling)."""
    batches = 2 if inputs.async_scheduling and inputs.version >= IN_FLIGHT_TOKENS else 1
    return inputs.max_num_batched_tokens * batches


def _layer_specs(
    geometry: Geometry, inputs: PlanInputs, block_sizes: dict[str, int], state_blocks: int, in_flight: int
) -> dict[str, LayerSpec]:
    """Each kind's spec: what a request holds in one of its layers, in blocks of the kind's own size."""
    lookahead = inputs.lookahead_tokens
    window = geometry.sliding_window or 0
    mml = inputs.max_model_len
    return {
        "full": FullAttentionSpec(block_sizes.get("full", 0), mml, lookahead),
        "mla": FullAttentionSpec(block_sizes.get("mla", 0), mml, lookahead),
        "sliding": SlidingWindowSpec(
            block_sizes.get("sliding", 0), mml, window, in_flight, lookahead, _retained(geometry, inputs)
        ),
        "chunked": ChunkedLocalSpec(
            block_sizes.get("chunked", 0), mml, geometry.attention_chunk_size or 0, in_flight, lookahead
        ),
        "mamba": StateSpec("mamba", state_blocks),
        "linear": StateSpec("linear", state_blocks),
    }


def _retained(geometry: Geometry, inputs: PlanInputs) -> int:
    """Tokens a sliding-window layer keeps below its window for a drafter of several MTP layers, which re-prefills
    the last ``num_speculative_tokens - 1`` (0.32 ``VllmConfig.num_prefill_lookahead_tokens``, applied to every
    ``SlidingWindowSpec`` in ``get_kv_cache_configs``)."""
    spec = inputs.speculation
    if spec is None or spec.method != "mtp" or min(geometry.mtp_layers, spec.num_speculative_tokens) <= 1:
        return 0
    if "sliding" in geometry.layer_kinds and inputs.version < SLIDING_MTP_RETAINED:
        raise NotModelled(
            f"{geometry.architecture}: sliding-window layers beside a multi-layer MTP drafter are planned from vLLM "
            f"{dotted(SLIDING_MTP_RETAINED)}, whose sources were read"
        )
    return spec.num_speculative_tokens - 1


def _groups(counts: Counter[str], group_size: int, specs: dict[str, LayerSpec], notes: list[str]) -> list[KvGroup]:
    """Each bucket cut into groups of ``group_size`` layers, the layers dealt round-robin; the rest is padding."""
    groups: list[KvGroup] = []
    for kind, n in counts.items():
        n_groups = math.ceil(n / group_size)
        for i in range(n_groups):
            groups.append(KvGroup(len(range(i, n, n_groups)), specs[kind]))
        if n_groups * group_size != n:
            pad = n_groups * group_size - n
            notes.append(f"{pad} padding layer(s) for the {kind} layers: up to {pad / n * 100:.2f}% of its memory idle")
    return groups


class PoolShape(NamedTuple):
    """The shape of the one block pool every group shares: the groups, layers per group, the bytes of one page (a
    block of one layer), full attention's bytes per token per layer, and the block size in tokens."""

    groups: list[KvGroup]
    group_size: int
    page: int
    per_layer: int
    block_size: int


def _pool(counts: Counter[str], shape: PoolShape, inputs: PlanInputs, notes: list[str]) -> KvPlan:
    """One pool of blocks for every group: how many, how many requests of max_model_len they hold, and vLLM's
    "KV cache size" in tokens."""
    groups, group_size, page, per_layer, block_size = shape
    max_model_len, memory = inputs.max_model_len, inputs.kv_cache_memory_bytes
    blocks = int(memory // (page * group_size))
    request_blocks = sum(g.blocks_per_request for g in groups)
    concurrency = blocks / request_blocks
    if inputs.version >= TOKENS_FROM_CONCURRENCY:
        tokens = int(concurrency * max_model_len)
        token_rule = "int(max_concurrency x max_model_len)"
    else:
        tokens = blocks // len(groups) * block_size
        token_rule = "blocks // groups x block_size"
    if concurrency < 1:
        needed = request_blocks * page * group_size
        raise ImpossiblePlan(
            f"one request of max_model_len {max_model_len:,} tokens needs {request_blocks:,} blocks of "
            f"{page * group_size / MiB:.2f} MiB ({needed / GiB:.2f} GiB) per GPU, more than the "
            f"{memory / GiB:.2f} GiB available; vLLM would refuse to start"
        )
    return KvPlan(
        kv_bytes_per_token=per_layer * (counts.get("full", 0) + counts.get("mla", 0)),
        kv_layers_per_rank=sum(counts.values()),
        block_size=block_size,
        num_gpu_blocks=blocks,
        kv_cache_tokens=tokens,
        max_concurrency=concurrency,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=memory,
        rules=f"v1 >= 0.9.1 hybrid groups: blocks / {request_blocks} blocks per request; tokens {token_rule}",
        notes=notes,
        groups=tuple(groups),
        group_size=group_size,
        page_bytes=page,
    )


def chunked_local_groups(inputs: PlanInputs) -> tuple[bool, str]:
    """Whether vLLM sizes chunked local attention layers in groups of their own (else like full attention), and why:
    the hybrid KV-cache manager is off for them with an EAGLE-family drafter (0.32 ``VllmConfig``), and otherwise
    follows VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE, whose default changed."""
    version, mode, spec = inputs.version, inputs.chunked_local_hybrid, inputs.speculation
    as_full = "chunked local attention layers are sized like full attention"
    if spec is not None and spec.method in ("eagle", "eagle3", "mtp"):
        return False, f"{as_full}: vLLM turns the hybrid KV-cache manager off for them with an EAGLE-family drafter"
    if version < CHUNKED_LOCAL_GROUPS or mode == "off":
        if mode == "on":
            raise NotModelled(
                f"chunked local attention has groups of its own from vLLM {dotted(CHUNKED_LOCAL_GROUPS)} (PR #19351)"
            )
        reason = "before 0.10.0 (PR #19351)" if version < CHUNKED_LOCAL_GROUPS else "--chunked-local-hybrid off"
        return False, f"{as_full} ({reason})"
    if mode == "auto" and version < CHUNKED_LOCAL_DEFAULT_ON:
        raise NotModelled(
            "whether vLLM gives chunked local attention groups of its own depends on "
            "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE, whose default was off from 0.10.1 (PR #21761) and "
            f"is on in {dotted(CHUNKED_LOCAL_DEFAULT_ON)}: pass --chunked-local-hybrid on or off as your server runs"
        )
    how = "--chunked-local-hybrid on"
    if mode == "auto":
        how = "the default of VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
    return True, f"chunked local attention layers have KV-cache groups of their own ({how})"
