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
