"""The bridge from a live server to the planner: vLLM's KV-cache groups as :mod:`vllm_capacity.sizing` lays them out
for the engine's own budget and settings, the drafter its log names, the CPU tier, and the model's bytes per token."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_capacity import sizing
from vllm_capacity.derive.facts import ServedModel, ServerFacts
from vllm_capacity.geometry import Geometry
from vllm_capacity.sources.vllm_metrics.records import SCHEMA_V0, CacheConfig


@dataclass(frozen=True)
class PlannedLayout:
    """vLLM's KV-cache groups as the planner lays them out for this engine's own KV memory and settings: by layer
    kind, the groups and the blocks a request of max_model_len holds in them; and whether vLLM's own capacity
    agrees (within one block per group)."""

    groups: Mapping[str, int]  # layer kind -> KV-cache groups of that kind
    blocks_per_request: Mapping[str, int]  # layer kind -> blocks a max_model_len request holds in its groups
    planned_tokens: int
    mismatch: bool | None  # None: vLLM reports no token capacity to compare
    assumed: str  # the settings the plan took that vLLM does not report
    worker_bytes_per_block: int = 0  # bytes of one block on one rank, over every layer
    latent: bool = False  # an MLA model: one latent per token, which every TP rank holds alike
    kv_bytes_per_token: int = 0  # the plan's, per rank: the release's rules, a logged drafter's layers included
    packed: bool = False  # DeepSeek-V4's packed groups, whose CPU tier the planner does not size


@dataclass(frozen=True)
class EnginePool:
    """One engine's KV pool as vLLM reports it, what the planner lays out for it: max_model_len, the pool's bytes
    (``kv_cache_memory_bytes``, else the log's KV memory), vLLM's token capacity to compare (None: none to compare),
    the log's device, and whether vLLM counts speculative drafts."""

    max_model_len: int | None
    pool_bytes: float | None
    capacity_tokens: int | None = None
    device: str | None = None
    counting: bool = False


def planned_layout(
    cc: CacheConfig | None, facts: ServerFacts, pool: EnginePool, rules: sizing.SizingRules
) -> PlannedLayout | None:
    """The planner's layout for vLLM's own budget (``kv_cache_memory_bytes``, else the log's KV memory), block size,
    dtype and Mamba settings; None without --model-config, a budget or max_model_len, or where the planner does not
    model the server. vLLM does not report its max_num_batched_tokens or async scheduling: the log's
    "Chunked prefill is enabled with max_num_batched_tokens=N" (else 2048) and async off only on the CPU backend.
    A speculative drafter is planned from the engine's logged config (:func:`live_speculation`; ``counting``: vLLM
    counts drafts); where it cannot be known, there is no layout rather than one that would disagree with vLLM for
    want of it."""
    geometry, max_model_len, pool_bytes = facts.model.geometry, pool.max_model_len, pool.pool_bytes
    if geometry is None or cc is None or not max_model_len or not pool_bytes or cc.block_size is None:
        return None
    if _backend_decides(geometry, cc.cache_dtype):
        return None
    spec, spec_assumed = live_speculation(LiveSpeculation(facts.speculation, pool.counting))
    if spec is _UNKNOWN:
        return None
    inputs = sizing.PlanInputs(
        kv_cache_memory_bytes=int(pool_bytes),
        max_model_len=max_model_len,
        tp=facts.model.tp,
        pp=facts.model.pp,
        kv_cache_dtype=cc.cache_dtype or "auto",
        block_size=cc.block_size,
        version=rules.release,
        engine_version=rules.engine_version,
        max_num_batched_tokens=facts.flags.max_num_batched_tokens or 2048,
        mamba_cache_mode=cc.labels.get("mamba_cache_mode", "auto"),
        mamba_ssm_cache_dtype=cc.labels.get("mamba_ssm_cache_dtype", "auto"),
        async_scheduling=pool.device != "CPU",
        speculation=spec if isinstance(spec, sizing.Speculation) else None,
    )
    plan = _plan(geometry, inputs)
    if plan is None:
        return None
    groups, per_request = _groups(plan, geometry, max_model_len)
    mismatch = None
    if pool.capacity_tokens is not None:
        mismatch = abs(pool.capacity_tokens - plan.kv_cache_tokens) > plan.block_size * sum(groups.values())
    assumed = _assumed(geometry, inputs, logged=facts.flags.max_num_batched_tokens is not None) + spec_assumed
    latent = "mla" in geometry.layer_kinds
    return PlannedLayout(groups, per_request, plan.kv_cache_tokens, mismatch, assumed, plan.worker_bytes_per_block,
                         latent, plan.kv_bytes_per_token, geometry.compressed is not None)  # fmt: skip


def _assumed(geometry: Geometry, inputs: sizing.PlanInputs, *, logged: bool) -> str:
    """What the live plan assumed that vLLM does not report (``logged``: the log gave max_num_batched_tokens)."""
    assumed = f"max_num_batched_tokens {inputs.max_num_batched_tokens}{'' if logged else ' (assumed)'}, "
    assumed += f"async scheduling {'on' if inputs.async_scheduling else 'off (CPU backend)'}"
    if sizing.sparse_latent_assumption(geometry, inputs.kv_cache_dtype):
        assumed += ", a 16-bit latent (not an SM120 GPU's fp8_ds_mla)"
    return assumed


def _groups(plan: sizing.KvPlan, geometry: Geometry, max_model_len: int) -> tuple[dict[str, int], dict[str, int]]:
    """By layer kind: the plan's KV-cache groups, and the blocks a request of max_model_len holds in them."""
    groups: dict[str, int] = {}
    per_request: dict[str, int] = {}
    if plan.groups:
        for g in plan.groups:
            groups[g.kind] = groups.get(g.kind, 0) + 1
            per_request[g.kind] = per_request.get(g.kind, 0) + g.blocks_per_request
    else:  # one kind of KV layer: vLLM's single group
        kind = "mla" if "mla" in geometry.layer_kinds else "full"
        groups[kind], per_request[kind] = 1, math.ceil(max_model_len / plan.block_size)
    return groups, per_request


@dataclass(frozen=True)
class LiveSpeculation:
    """What the agent knows of the server's speculative decoding: the (method, num_speculative_tokens) vLLM's engine
    logged (None: none, or no log) and whether vLLM counts speculative drafts (its spec_decode_* counters, there
    from the start when it speculates)."""

    logged: tuple[str, int] | None = None
    counting: bool = False


_UNKNOWN = object()
_WITHOUT_LAYERS = ("ngram", "ngram_gpu", "suffix")  # drafts from the prompt: no KV layers of their own


def live_speculation(seen: LiveSpeculation) -> tuple[object, str]:
    """The drafter to plan the live layout with: a Speculation, None (no speculation) or _UNKNOWN (speculating in
    a way the agent cannot size: a separate draft model, whose config it does not have, or a method the log did not
    name); and what was assumed, for the layout's ``assumed`` text."""
    if seen.logged is None:
        return (_UNKNOWN, "") if seen.counting else (None, "")
    method, tokens = seen.logged
    if method in _WITHOUT_LAYERS:
        return sizing.Speculation("ngram", tokens), f", {method} speculation of {tokens} tokens"
    if method == "mtp" or method.endswith("_mtp"):
        own = "the model's own layers; Gemma 4's assistant reads its KV"
        return sizing.Speculation("mtp", tokens), f", MTP speculation of {tokens} tokens ({own})"
    if method in ("eagle", "eagle3"):
        return (
            sizing.Speculation(method, tokens),
            f", {method} speculation of {tokens} tokens (its head assumed one layer shaped like the model's)",
        )
    return _UNKNOWN, ""


def cpu_capacity_tokens(
    cc: CacheConfig | None,
    schema: str,
    layout: PlannedLayout | None,
    *,
    tp: int,
    pp: int,
    version: tuple[int, int, int],
) -> int | None:
    """The CPU tier in tokens: V0's swap space (cache_config_info num_cpu_blocks x block_size), or V1's native KV
    offloading (kv_offloading_size GiB, from 0.32) sized from the planned bytes per block; None when there is none
    or it cannot be sized (offloading without --model-config, another backend, a release not read, DeepSeek-V4's
    packed groups, or an MLA model under TP alone, whose tier holds one copy or one per rank by the executor and
    nodes, which vLLM does not report)."""
    if cc is None or cc.block_size is None:
        return None
    if schema == SCHEMA_V0:
        return cc.num_cpu_blocks * cc.block_size if cc.num_cpu_blocks is not None else None
    gib = cc.kv_offloading_size_gib
    if gib is None or layout is None or layout.packed or cc.labels.get("kv_offloading_backend", "native") != "native":
        return None
    if sizing.latent_shared_by_ranks(mla=layout.latent, tp=tp, pp=pp):
        return None
    try:
        return sizing.cpu_tier_tokens(
            offloading_bytes=int(gib * (1 << 30)),
            worker_bytes_per_block=layout.worker_bytes_per_block,
            world_size=tp * pp,
            block_size=cc.block_size,
            version=version,
        )
    except ValueError:  # a release whose tier was not read (NotModelled), or a size below zero
        return None


@functools.lru_cache(maxsize=64)
def _plan(geometry: Geometry, inputs: sizing.PlanInputs) -> sizing.KvPlan | None:
    """One plan per distinct server setting (the scrape loop asks every cycle); None where the planner refuses."""
    try:
        return sizing.plan(geometry, inputs)
    except ValueError:  # NotModelled, ImpossiblePlan, a dtype it does not know: no layout, never a wrong one
        return None


def model_kv_bytes_per_token(geometry: Geometry | None, cache_dtype: str | None, tp: int, pp: int) -> float | None:
    """Bytes per token per GPU rank from the model's geometry; None where the planner does not model it, or where no
    one figure is per token (DeepSeek-V4: windows, compressed latents and states in groups of their own)."""
    if geometry is None or not geometry.uniform or geometry.unmodelled_cache or geometry.compressed is not None:
        return None
    if _backend_decides(geometry, cache_dtype):
        return None
    try:
        dtype_bytes = sizing.kv_dtype_bytes(cache_dtype or "auto", geometry.dtype)
        geometry = sizing.packed_rows(geometry, cache_dtype or "auto")
    except ValueError:
        return None
    layers = sizing.layers_per_rank(geometry.kv_layers, pp)
    return sizing.bytes_per_token_per_layer(geometry, tp, dtype_bytes) * layers


def _backend_decides(geometry: Geometry, cache_dtype: str | None) -> bool:
    """A sparse-attention model under an fp8 dtype: its latent is plain fp8 or the packed fp8_ds_mla by the GPU's
    attention backend, which vLLM does not report (the plan assumes, and says; the live agent gives no figure)."""
    name = (cache_dtype or "auto").lower()
    return sizing.sparse_latent_assumption(geometry, name) is not None and name != "auto"


def planned_bytes_per_token(model: ServedModel, cc: CacheConfig | None, layout: PlannedLayout | None) -> float | None:
    """The model's bytes per token per rank: the planned layout's where there is one (it knows the release's rules
    and the drafter the engine logged, whose layers share the pool), else the geometry's alone."""
    alone = model_kv_bytes_per_token(model.geometry, cc.cache_dtype if cc else None, model.tp, model.pp)
    if alone is None or layout is None or not layout.kv_bytes_per_token:
        return alone
    return layout.kv_bytes_per_token
