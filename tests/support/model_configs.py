"""config.json documents of real models the tests plan, written out where no file of them is kept."""

from __future__ import annotations

from typing import Any

# Kimi-Linear-48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct): 27 layers, 7 MLA (kv_lora_rank 512 + rope 64) and
# 20 KDA (32 heads of 128, conv kernel 4), as its linear_attn_config lists them (1-based); its other fields (experts,
# vocabulary) do not size the cache
KIMI_LINEAR: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 1048576,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}

# meta-llama/Llama-3.1-8B-Instruct config.json (the fields vLLM's LoRA layers are shaped by)
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
    "torch_dtype": "bfloat16", "max_position_embeddings": 131072,
}  # fmt: skip

# a Gemma 4 text config as transformers' Gemma4TextConfig reads it: 5 sliding layers to 1 full
GEMMA4: dict[str, Any] = {
    "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 12,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2, "torch_dtype": "bfloat16",
}  # fmt: skip

# DeepSeek-V4-Flash's shape (transformers' DeepseekV4Config defaults, "deepseek-ai/DeepSeek-V4-Flash-Base": 43 layers,
# head_dim 512, one KV head, window 128, index_head_dim 128) with compress_ratios as its config.json lists them: two
# sliding-window-only layers, then ratio 4 and 128 by turns (its MTP layer's trailing entry left off)
DEEPSEEK_V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hidden_layers": 43,
    "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4], "index_topk": 512, "index_n_heads": 64, "index_head_dim": 128,
    "torch_dtype": "bfloat16", "vocab_size": 129280, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
}  # fmt: skip
# DeepSeek-V4-Pro's layer pattern (transformers' default layer_types for V4: two ratio-128 layers, then 128 and 4 by
# turns), 61 layers: 32 of ratio 128 to 29 of ratio 4
DEEPSEEK_V4_PRO: dict[str, Any] = {
    **DEEPSEEK_V4_FLASH, "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
    "compress_ratios": [128, 128] + [128, 4] * 29 + [128],
}  # fmt: skip
# ratio 128 and sliding-window-only layers, no ratio 4 (so no indexer): no bucket mixes page sizes, and vLLM cuts the
# sliding ones into groups no wider than the widest page
DEEPSEEK_V4_NO_INDEXER: dict[str, Any] = {
    **DEEPSEEK_V4_FLASH, "num_hidden_layers": 12, "compress_ratios": [0, 128, 0, 128] * 3,
}  # fmt: skip

# Granite 4.0 micro: a GraniteMoeHybrid config whose 40 layers are all attention (hidden 2560, 40 heads, 8 KV heads
# of 64: model-geometry.json), with the Mamba-2 fields of its family (64-wide heads, expand 2, one group, d_state 256,
# d_conv 4, as in granite-4.0-h-small and -tiny). They give the 1,312-token block the issue reports for vLLM 0.11.
GRANITE_4_MICRO: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "hidden_size": 2560,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "layer_types": ["attention"] * 40,
    "mamba_n_heads": 80,
    "mamba_d_head": 64,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
