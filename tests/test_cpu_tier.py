"""The CPU tier of vLLM's KV cache: V1's native offloading (planned from vLLM 0.32's spec: page-aligned chunks of
every rank's block bytes) and V0's swap space (vLLM's own num_cpu_blocks)."""

from __future__ import annotations

import math

import pytest

from support.files import fixture_text
from support.model_configs import DEEPSEEK_V4_FLASH
from vllm_capacity import derive, sizing
from vllm_capacity.sizing import NotModelled, PlanInputs, SizingRules, cpu_tier_tokens
from vllm_capacity.sizing.offload import HOST_PAGE_BYTES, OFFLOAD_RULES
from vllm_capacity.sources.model_config import parse_config
from vllm_capacity.sources.vllm_metrics.parse import parse_metrics
from vllm_capacity.sources.vllm_metrics.records import SCHEMA_V0, SCHEMA_V1_CAPACITY, CacheConfig

GiB = 2**30
LLAMA_8B = parse_config(
    {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
     "torch_dtype": "bfloat16"}
)  # fmt: skip


def test_chunks_of_every_ranks_block_bytes_page_aligned() -> None:
    # Llama-3.1-8B, TP 2: a block is 32 layers x 4 heads x 128 x 2 (K, V) x 2 B x 16 tokens = 1 MiB per rank
    per_rank = 32 * 4 * 128 * 2 * 2 * 16
    tokens = cpu_tier_tokens(offloading_bytes=64 * GiB, worker_bytes_per_block=per_rank, world_size=2, block_size=16,
                             version=OFFLOAD_RULES)  # fmt: skip
    assert tokens == 64 * GiB // (2 * per_rank) * 16
    # a chunk that is not a whole number of host pages is rounded up to one
    odd = cpu_tier_tokens(offloading_bytes=10 * HOST_PAGE_BYTES, worker_bytes_per_block=HOST_PAGE_BYTES + 1,
                          world_size=1, block_size=16, version=OFFLOAD_RULES)  # fmt: skip
    assert odd == 5 * 16
    with pytest.raises(NotModelled, match=r"0\.32\.0"):
        cpu_tier_tokens(offloading_bytes=GiB, worker_bytes_per_block=per_rank, world_size=1, block_size=16,
                        version=(0, 31, 0))  # fmt: skip


def test_plan_shows_the_cpu_tier_and_refuses_what_it_does_not_model() -> None:
    plan = sizing.plan(
        LLAMA_8B, PlanInputs(kv_cache_memory_bytes=40 * GiB, max_model_len=32768, tp=2, kv_offloading_bytes=64 * GiB)
    )
    assert plan.worker_bytes_per_block == plan.kv_bytes_per_token * 16 == 32 * 4 * 128 * 2 * 2 * 16
    assert plan.cpu_tier_tokens == 64 * GiB // (2 * plan.worker_bytes_per_block) * 16
    assert "do not add concurrency" in plan.notes[-1]
    same = sizing.plan(LLAMA_8B, PlanInputs(kv_cache_memory_bytes=40 * GiB, max_model_len=32768, tp=2))
    assert (same.num_gpu_blocks, same.cpu_tier_tokens) == (plan.num_gpu_blocks, None)  # the GPU side is unchanged
    with pytest.raises(NotModelled, match="V1 feature"):
        sizing.plan(LLAMA_8B, PlanInputs(kv_cache_memory_bytes=GiB, max_model_len=4096, engine_version="v0",
                                         version=(0, 9, 2), kv_offloading_bytes=GiB))  # fmt: skip


MLA = parse_config({"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"})


def test_an_mla_models_ranks_share_one_copy_under_tp_alone() -> None:
    # the latent is the same on every TP rank: vLLM 0.32 keeps one host copy (replicated_layout) under TP alone
    per_rank = 4 * 576 * 2 * 16  # four layers of one 576-wide bf16 latent, 16 tokens a block
    tp4 = sizing.plan(MLA, PlanInputs(kv_cache_memory_bytes=GiB, max_model_len=4096, tp=4, kv_offloading_bytes=8 * GiB))
    assert tp4.worker_bytes_per_block == per_rank
    assert tp4.cpu_tier_tokens == 8 * GiB // (math.ceil(per_rank / HOST_PAGE_BYTES) * HOST_PAGE_BYTES) * 16
    assert "one copy of the latent" in tp4.notes[-1] and "4x fewer" in tp4.notes[-1]  # the assumption, named
    # under PP each stage holds other layers: a copy per rank, as for any model
    pp2 = sizing.plan(MLA, PlanInputs(kv_cache_memory_bytes=GiB, max_model_len=4096, pp=2, kv_offloading_bytes=8 * GiB))
    assert pp2.cpu_tier_tokens == 8 * GiB // (2 * pp2.worker_bytes_per_block) * 16
    assert "over 2 rank(s)" in pp2.notes[-1]
    # live, the agent cannot see the executor or the nodes that decide it: no figure rather than a wrong one
    labels = {"block_size": "16", "kv_offloading_size": "8.0", "kv_offloading_backend": "native"}
    cc = CacheConfig(labels)
    live = {
        (tp, pp): derive.cpu_capacity_tokens(
            cc, SCHEMA_V1_CAPACITY,
            derive.planned_layout(cc, derive.ServerFacts(model=derive.ServedModel(MLA, tp=tp, pp=pp)),
                                  derive.EnginePool(max_model_len=4096, pool_bytes=GiB), SizingRules("v1", (0, 32, 0))),
            tp=tp, pp=pp, version=(0, 32, 0),
        )
        for tp, pp in ((1, 1), (4, 1), (1, 2))
    }  # fmt: skip
    assert live[(4, 1)] is None
    assert live[(1, 2)] == pp2.cpu_tier_tokens
    assert live[(1, 1)] == sizing.plan(MLA, PlanInputs(kv_cache_memory_bytes=GiB, max_model_len=4096,
                                   kv_offloading_bytes=8 * GiB)).cpu_tier_tokens  # fmt: skip


def test_live_cpu_tier_v0_swap_and_v1_offloading() -> None:
    (v0,) = derive.derive_all(
        parse_metrics(fixture_text("v0-0.6.6-multiprocess.prom")),
        derive.ServerFacts(flags=derive.ServerFlags(max_model_len=8192)),
    )
    assert v0.cpu_capacity_tokens == 2048 * 16  # num_cpu_blocks="2048" of 16 tokens: V0's swap space
    (plain,) = derive.derive_all(
        parse_metrics(fixture_text("v1-0.24-seed.prom")), derive.ServerFacts(max_model_len={"gemma-12b": 32768})
    )
    assert plain.cpu_capacity_tokens is None  # V1 without offloading: no CPU tier, not zero
    labels = {"block_size": "16", "kv_cache_memory_bytes": str(40 * GiB), "kv_offloading_size": "64.0",
              "kv_offloading_backend": "native"}  # fmt: skip
    cc = CacheConfig(labels)
    layout = derive.planned_layout(
        cc, derive.ServerFacts(model=derive.ServedModel(LLAMA_8B, tp=2)),
        derive.EnginePool(max_model_len=32768, pool_bytes=40 * GiB), SizingRules("v1", (0, 32, 0)),
    )  # fmt: skip
    assert layout is not None
    tokens = derive.cpu_capacity_tokens(cc, SCHEMA_V1_CAPACITY, layout, tp=2, pp=1, version=(0, 32, 0))
    assert tokens == 64 * GiB // (2 * 32 * 4 * 128 * 2 * 2 * 16) * 16
    assert derive.cpu_capacity_tokens(cc, SCHEMA_V1_CAPACITY, None, tp=2, pp=1, version=(0, 32, 0)) is None
    lmcache = CacheConfig({**labels, "kv_offloading_backend": "lmcache"})  # sized by LMCache's own server
    assert derive.cpu_capacity_tokens(lmcache, SCHEMA_V1_CAPACITY, layout, tp=2, pp=1, version=(0, 32, 0)) is None
    older = derive.cpu_capacity_tokens(cc, SCHEMA_V1_CAPACITY, layout, tp=2, pp=1, version=(0, 28, 0))
    assert older is None  # a release whose tier was not read
    assert derive.cpu_capacity_tokens(CacheConfig({"block_size": "16", "num_cpu_blocks": "x"}), SCHEMA_V0, None,
                                      tp=1, pp=1, version=(0, 6, 6)) is None  # fmt: skip


def test_live_deepseek_v4_gets_its_layout_but_no_cpu_tier_and_no_one_bytes_per_token() -> None:
    """Beside a DeepSeek-V4 server the agent lays out its packed groups as the planner does, but sizes no CPU tier
    (the planner refuses V4 with --kv-offloading-size: its packed tier is not modelled) and gives no model_config
    bytes per token (windows, compressed latents and states: no one figure per token). Before V4 was planned, its
    geometry was refused whole; once planned, it read as 43 uniform MLA layers of 512 x 2 B: a figure of a cache
    vLLM does not have."""
    v4 = parse_config(DEEPSEEK_V4_FLASH)
    labels = {"block_size": "256", "kv_cache_memory_bytes": str(20 * GiB), "kv_offloading_size": "64.0",
              "kv_offloading_backend": "native"}  # fmt: skip
    cc = CacheConfig(labels)
    layout = derive.planned_layout(
        cc, derive.ServerFacts(model=derive.ServedModel(v4)),
        derive.EnginePool(max_model_len=131072, pool_bytes=20 * GiB), SizingRules("v1", (0, 32, 0)),
    )  # fmt: skip
    assert layout is not None and layout.packed
    assert layout.groups == {"sliding": 4, "full": 1}
    assert derive.cpu_capacity_tokens(cc, SCHEMA_V1_CAPACITY, layout, tp=1, pp=1, version=(0, 32, 0)) is None
    assert derive.model_kv_bytes_per_token(v4, "auto", tp=1, pp=1) is None
    assert derive.planned_bytes_per_token(derive.ServedModel(v4), cc, layout) is None
